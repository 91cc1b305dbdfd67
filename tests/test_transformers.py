"""attn_implementation="biasattn" in Hugging Face transformers against "sdpa" (tiny random-weight models, CPU)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import biasattn as ba  # noqa: E402
import biasattn.integrations.transformers as bt  # noqa: E402

VOCAB = 97


@pytest.fixture(scope="module", autouse=True)
def _registered():
    bt.register()


def llama(**kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **kw}))


def mistral():
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, sliding_window=4, max_position_embeddings=64)
    return transformers.MistralForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


RIGHT = torch.tensor([[1] * 9 + [0] * 3, [1] * 12, [1] * 5 + [0] * 7])
LEFT = RIGHT.flip(-1)


def logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    return model(**inputs).logits


@pytest.mark.parametrize("make", [llama, gpt2, mistral], ids=["llama-gqa", "gpt2", "mistral-sliding-window"])
@pytest.mark.parametrize("mask", [RIGHT, LEFT], ids=["right-padding", "left-padding"])
def test_logits_match_sdpa_on_padded_batch(make, mask):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, VOCAB, mask.shape)
    with torch.no_grad():
        ours = logits(model, "biasattn", input_ids=ids, attention_mask=mask)
        ref = logits(model, "sdpa", input_ids=ids, attention_mask=mask)
    valid = mask.bool()  # padded query positions are ignored by the model (sdpa's values there are arbitrary)
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-5, rtol=1e-5)


def test_training_gradients_match_sdpa():
    torch.manual_seed(0)
    model = llama().train()
    ids = torch.randint(0, VOCAB, RIGHT.shape)
    grads = {}
    for impl in ("biasattn", "sdpa"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(input_ids=ids, attention_mask=RIGHT, labels=ids.masked_fill(RIGHT == 0, -100)).loss.backward()
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["biasattn"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("make", [llama, mistral], ids=["llama-gqa", "mistral-sliding-window"])
def test_generation_with_cache_matches_sdpa(make):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, VOCAB, LEFT.shape)
    out = {}
    for impl in ("biasattn", "sdpa"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=LEFT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out["biasattn"], out["sdpa"])


def test_packed_sequences_become_block_diagonal(attention_spy):
    torch.manual_seed(0)
    model = llama().eval()
    ids = torch.randint(0, VOCAB, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    seen = attention_spy(bt)
    with torch.no_grad():
        ours = logits(model, "biasattn", input_ids=ids, position_ids=pos, use_cache=False)
        ref = logits(model, "sdpa", input_ids=ids, position_ids=pos, use_cache=False)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert isinstance(seen[0], ba.BlockDiagonalMask) and seen[0].q_seqlens == [5, 3, 4]


def test_padding_reaches_attention_as_lengths(attention_spy):
    """No dense mask: right padding arrives as PaddedKeysMask lengths with the causal band."""
    seen = attention_spy(bt)
    model = llama().eval()
    with torch.no_grad():
        logits(model, "biasattn", input_ids=torch.randint(0, VOCAB, RIGHT.shape), attention_mask=RIGHT)
    assert {a.kind for a in seen[0].atoms} == {"padded_keys", "band"}
    assert seen[0].atoms[0].lengths() == (9, 12, 5)


def test_layers_of_one_forward_share_one_bias(attention_spy):
    """Every layer of a forward pass gets the bias built for the first (one spec: one dispatch walk,
    one read of the lengths); the next forward, with its own mask tensor, gets a new one."""
    seen = attention_spy(bt)
    model = llama(num_hidden_layers=3).eval()
    ids = torch.randint(0, VOCAB, RIGHT.shape)
    with torch.no_grad():
        logits(model, "biasattn", input_ids=ids, attention_mask=RIGHT)
        logits(model, "biasattn", input_ids=ids, attention_mask=RIGHT.clone())
    assert len(seen) == 6
    assert seen[0] is seen[1] is seen[2] and seen[3] is seen[4] is seen[5]
    assert seen[3] is not seen[0]


def _layer(q, k, mask, **kw):
    class Layer(torch.nn.Module):
        is_causal = True

    return bt.attention_forward(Layer(), q, k, k, mask, **kw)[0]


def test_a_mask_changed_in_place_gets_a_new_bias(attention_spy):
    seen = attention_spy(bt)
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    first = _layer(q, k, mask)
    assert seen[-1].atoms[0].lengths() == (6, 4)
    mask[0, 3:] = False  # the same tensor object, edited: its version moves on
    second = _layer(q, k, mask)
    assert seen[-1].atoms[0].lengths() == (3, 4)
    expect = ba.attention(q, k[:, :, :3], k[:, :, :3])[:1].transpose(1, 2)
    torch.testing.assert_close(second[:1], expect)
    torch.testing.assert_close(second[1:], first[1:])


def test_a_shared_bias_follows_the_call_sizes(attention_spy):
    """The same mask object with another key length (a static cache cut to the mask) or query count
    builds its own bias."""
    seen = attention_spy(bt)
    mask = torch.tensor([[True] * 5 + [False], [True] * 6])
    q = torch.randn(2, 4, 2, 8)
    _layer(q, torch.randn(2, 2, 6, 8), mask)
    _layer(q[:, :, :1], torch.randn(2, 2, 6, 8), mask)
    _layer(q, torch.randn(2, 2, 9, 8), mask)  # 9 slots, 6 in the mask: keys cut to 6
    assert seen[0] is not seen[1] and seen[2] is not seen[0]
    assert seen[2].atoms[0].lengths() == (5, 6)


def _docs_example() -> str:
    """The transformers example of docs/integrations.md (the block after its ``run if=transformers`` marker)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    block = text.split("<!-- run if=transformers -->", 1)[1].split("```python\n", 1)[1]
    return block.split("```", 1)[0]


def test_docs_example_runs_offline_and_matches_sdpa(capsys):
    """The documented example (LlamaConfig, from_config, register()) runs on the CPU without a download."""
    ns: dict = {}
    exec(compile(_docs_example(), "docs/integrations.md", "exec"), ns)
    out = capsys.readouterr().out
    assert "attention: biasattn" in out and "largest difference from sdpa on real tokens" in out
    model, real = ns["model"].double(), ns["mask"].bool()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=ns["ids"], attention_mask=ns["mask"]).logits  # float64
    ours_err = (ns["ours"].double() - ref)[real].abs().max()
    sdpa_err = (ns["theirs"].double() - ref)[real].abs().max()  # the same model in float32 through sdpa
    assert ours_err <= 2 * sdpa_err + 1e-6


def test_forgotten_register_names_the_implementation():
    """The error a model raises for a name register() never added (what docs/integrations.md shows)."""
    name = "biasattn_not_registered"
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=f'attn_implementation="{name}"` is not supported'):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    assert bt.register(name) == name
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    assert model.config._attn_implementation == name
