"""Helpers shared by the engine tests (a plain module: pytest puts tests/ on sys.path)."""

import torch

TOL = 1e-4  # max |logit difference| of a warm run to its cold run (fp32)


def tokens(n, seed=0):
    """``n`` seeded token ids inside every tiny model's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def assert_same_answer(warm, cold):
    """The same greedy tokens and last-position logits within TOL."""
    assert warm.output_ids == cold.output_ids
    assert (warm.last_logits - cold.last_logits).abs().max().item() <= TOL
