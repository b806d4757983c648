"""A layout run against the cache equals one uncached forward with the same visibility."""

import torch

from fastforward.model import Layout, visibility


def _uncached_sbd(tiny, tokens, commit_end, block):
    """Full forward: causal up to `commit_end`, then a block that sees everything before it and itself."""
    n = tokens.shape[1]
    rule = visibility.causal(n)
    rule[commit_end:, commit_end:] = True
    positions = torch.arange(n)[None]
    read = torch.arange(commit_end, n)
    layout = Layout(tokens, positions, rule[None], read=read)
    return tiny.run(layout, cache=None)


def test_block_against_cache_equals_uncached_forward(tiny):
    torch.manual_seed(0)
    prefix, commit, block = 11, 5, 6
    tokens = torch.randint(0, 290, (1, prefix + commit + block))
    tokens[0, prefix + commit :] = tiny.mask_token_id
    expected = _uncached_sbd(tiny, tokens, prefix + commit, block)

    cache = tiny.new_cache()
    with torch.inference_mode():
        head = Layout(tokens[:, :prefix], torch.arange(prefix)[None], visibility.causal(prefix)[None])
        tiny.run(head, cache)
        rule = visibility.sbd_decode(commit, block)
        mask = visibility.over_cache(rule, prefix)
        step = Layout(
            tokens[:, prefix:],
            torch.arange(prefix, prefix + commit + block)[None],
            mask,
            read=torch.arange(commit, commit + block),
        )
        got = tiny.run(step, cache)
        cache.truncate(prefix + commit)  # the committed tokens stay, the block's masks go
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == prefix + commit


def test_kept_entries_equal_causal_prefill(tiny):
    torch.manual_seed(1)
    tokens = torch.randint(0, 290, (1, 20))
    full = tiny.new_cache()
    split = tiny.new_cache()
    with torch.inference_mode():
        tiny.run(Layout(tokens, torch.arange(20)[None], visibility.causal(20)[None]), full)
        tiny.run(Layout(tokens[:, :12], torch.arange(12)[None], visibility.causal(12)[None]), split)
        # 8 committed tokens travel with 4 masks that are read and then dropped
        step_tokens = torch.cat([tokens[:, 12:], torch.full((1, 4), tiny.mask_token_id)], 1)
        mask = visibility.over_cache(visibility.sbd_decode(8, 4), 12)
        tiny.run(Layout(step_tokens, torch.arange(12, 24)[None], mask, read=None), split)
        split.truncate(20)
    assert split.get_seq_length() == 20
    for a, b in zip(full.layers, split.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)
