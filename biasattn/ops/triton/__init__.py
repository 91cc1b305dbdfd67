"""Triton flash-attention kernels, their launchers and tile configurations."""
