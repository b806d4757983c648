import torch
from transformers import DynamicCache

from fastforward.cache import GrowingLayer, gather_entries, new_cache, spare_room, truncate
from fastforward.tiny import tiny_model


def _entries(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 2, length, 4, generator=torch.Generator().manual_seed(seed))


def test_growing_layer_holds_what_concatenation_would_across_appends_crops_and_regrowth():
    layer, reference = GrowingLayer(), []
    for step, length in enumerate([5, 1, 3, 70, 1, 200]):  # 70 and 200 outgrow the buffer
        new = _entries(length, seed=step)
        keys, values = layer.update(new, -new)
        reference.append(new)
        expected = torch.cat(reference, dim=2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        assert layer.buffers[0].shape[2] % 64 == 0 and layer.buffers[0].shape[2] > keys.shape[2]
        if step == 2:  # roll back two entries: the next append overwrites their slots
            layer.crop(-2)
            reference[-1] = reference[-1][:, :, :1]
    assert spare_room(layer.keys[1]) and not spare_room(expected)


def test_growing_layer_after_the_batch_is_reordered_copies_into_new_buffers():
    layer = GrowingLayer()
    first = _entries(6)
    layer.update(first, first)
    layer.batch_select_indices(torch.tensor([1]))
    second = _entries(1, batch=1, seed=1)
    keys, _ = layer.update(second, second)
    assert torch.equal(keys, torch.cat([first[1:], second], dim=2))
    assert keys.data_ptr() == layer.buffers[0].data_ptr()


def test_model_caches_grow_in_place_and_roll_back_like_transformers_cache():
    model = tiny_model(seed=0)
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    with torch.inference_mode():
        caches = [model.new_cache(), DynamicCache(config=model.hf.config)]
        assert all(isinstance(layer, GrowingLayer) for layer in caches[0].layers)
        for cache in caches:
            model.hf(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
            model.hf(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True)
            gather_entries(cache, 3, torch.tensor([[2, 0]]))
            truncate(cache, 5)
        for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert new_cache(model.hf.config).get_seq_length() == 0
