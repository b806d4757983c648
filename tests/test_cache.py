"""`fastforward.model.cache`: growing KV layers hold what transformers' concatenating ones hold."""

import functools

import torch
from transformers import DynamicCache, LlamaForCausalLM, MistralConfig

from fastforward.model import Model
from fastforward.model.cache import MIN_CAPACITY, GrowingLayer, KVCache
from fastforward.model.tiny import tiny_model


def entries(n: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 3, n, 16, generator=torch.Generator().manual_seed(seed))


def test_growing_layer_appends_crops_and_grows_like_a_concatenation():
    layer, expected = GrowingLayer(), torch.zeros(2, 3, 0, 16)
    for step, n in enumerate([5, 1, 1, 40, 30, 1, 90]):  # past 64 and 128 entries: the buffers grow
        new = entries(n, step)
        keys, values = layer.update(new, -new)
        expected = torch.cat([expected, new], dim=2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        if step == 3:  # drop the last 7: the next append overwrites them
            layer.crop(-7)
            expected = expected[:, :, :-7]
            assert torch.equal(layer.keys, expected) and layer.get_seq_length() == expected.shape[2]
    assert layer.key_buffer.shape[2] == 4 * MIN_CAPACITY > layer.get_seq_length()


def test_reserve_leaves_a_spare_entry_and_keeps_the_entries():
    layer = GrowingLayer()
    layer.update(entries(10, 0), entries(10, 1))
    before = layer.keys.clone()
    layer.reserve(MIN_CAPACITY)  # exactly the capacity: one more is needed
    assert layer.key_buffer.shape[2] == 2 * MIN_CAPACITY and torch.equal(layer.keys, before)


def test_batch_selection_and_reset():
    layer = GrowingLayer()
    layer.update(entries(4, 0), entries(4, 1))
    kept = layer.keys[[1]].clone()
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, kept)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None


def test_cached_steps_equal_a_concatenating_cache_bit_for_bit(tiny, prompts, cached_step):
    """Prefill, one-token steps across two buffer growths, a rollback, a block: the same logits and
    entries as transformers' DynamicCache."""
    growing, concatenating = tiny.new_cache(), KVCache(DynamicCache(config=tiny.hf.config))
    assert all(type(layer) is GrowingLayer for layer in growing.layers)
    prompt = prompts[2]

    run = functools.partial(cached_step, tiny)
    with torch.inference_mode():
        pairs = [(run(growing, prompt), run(concatenating, prompt))]
        for step in range(140):
            token = int(pairs[-1][0][0, -1].argmax())
            pairs.append((run(growing, [token]), run(concatenating, [token])))
            if step == 70:
                growing.truncate(growing.get_seq_length() - 5)
                concatenating.truncate(concatenating.get_seq_length() - 5)
        pairs.append((run(growing, [3, 4, 5, 6]), run(concatenating, [3, 4, 5, 6])))
    assert growing.get_seq_length() == concatenating.get_seq_length() == len(prompt) + 140 - 5 + 4 > 2 * MIN_CAPACITY
    assert all(torch.equal(a, b) for a, b in pairs)
    for a, b in zip(growing.layers, concatenating.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_gather_entries_moves_entries_within_the_buffers(tiny):
    cache = tiny.new_cache()
    layer = cache.layers[0]
    for other in cache.layers:
        other.update(entries(6, 0), entries(6, 1))
    before = layer.keys.clone()
    cache.gather_entries(2, torch.tensor([[3, 1], [0, 2]]))  # row 0 keeps entries 5, 3; row 1 entries 2, 4
    assert torch.equal(layer.keys[0, :, 2:4], before[0, :, [5, 3]])
    assert torch.equal(layer.keys[1, :, 2:4], before[1, :, [2, 4]])


def test_reserve_makes_room_in_every_growing_layer(tiny):
    cache = tiny.new_cache()
    for layer in cache.layers:
        layer.update(entries(3, 0), entries(3, 1))
    cache.reserve(200)
    assert all(layer.key_buffer.shape[2] > 200 for layer in cache.layers)


def test_sliding_window_layers_keep_every_entry_and_their_positions():
    """A sliding layer grows like a full one (its masks hide what the window no longer shows), so
    rolling back works; the positions of the entries follow every truncation and gather."""
    config = MistralConfig(num_hidden_layers=2, sliding_window=8, hidden_size=32, num_attention_heads=2)
    cache = KVCache.new(config)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer] * 2
    kv = torch.zeros(2, 2, 5, 16)
    assert cache.track_positions(torch.tensor([[0, 1, 2, 3, 4], [7, 9, 8, 3, 1]])).shape == (2, 5)
    for i, layer in enumerate(cache.layers):
        layer.update(kv, kv, i)
    cache.gather_entries(1, torch.tensor([[2, 0], [3, 1]]))
    cache.truncate(3)
    assert cache.key_positions.tolist() == [[0, 3, 1], [7, 1, 8]]
    assert cache.get_seq_length() == 3


def test_a_model_that_takes_past_key_values_gets_its_cache_there(cached_step):
    """transformers 5.2x names the forward's cache argument `cache`; models written for older
    releases (remote code) still take `past_key_values`."""

    class OlderModel(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, **kwargs):
            return super().forward(input_ids, attention_mask, position_ids, cache=past_key_values, **kwargs)

    current = tiny_model(seed=0)
    older = Model(OlderModel(current.hf.config), current.tokenizer)
    older.hf.load_state_dict(current.hf.state_dict())
    assert (current.cache_argument, older.cache_argument) == ("cache", "past_key_values")
    with torch.inference_mode():
        logits = []
        for model in (current, older):
            cache = model.new_cache()
            cached_step(model, cache, [1, 2, 3])
            logits.append(cached_step(model, cache, [4]))
            assert cache.get_seq_length() == 4
    assert torch.equal(*logits)
