"""Which decoder layers go to which GPU, and which routed experts each GPU holds (docs/sizing.md §5)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hybridmoe.backend.plan.stats import ExpertStats


def split_layers(num_layers: int, budgets: Sequence[int]) -> list[tuple[int, ...]]:
    """Contiguous runs of layers per card, in proportion to the cards' budgets (pipeline split).

    Pipeline parallelism keeps each layer whole on one card, so each card holds only its
    own layers' weights and KV cache and only activations cross between cards.
    """
    if not budgets:
        return []
    positive = [max(b, 0) for b in budgets]
    total = sum(positive) or len(budgets)
    weights = [p / total if sum(positive) else 1 / len(budgets) for p in positive]
    runs, start, acc = [], 0, 0.0
    for i, w in enumerate(weights):
        acc += w
        end = num_layers if i == len(weights) - 1 else min(num_layers, round(acc * num_layers))
        runs.append(tuple(range(start, end)))
        start = end
    return runs


def uniform(
    avail_by_card: Sequence[int],
    moe_layers_by_card: Sequence[Sequence[int]],
    bytes_per_expert: Mapping[int, float],
    n_experts: int,
    stats: ExpertStats | None = None,
) -> dict[int, tuple[int, ...]]:
    """The same number of GPU experts in every MoE layer: as many as the tightest card allows.

    Without statistics the experts kept are the lowest ids (any choice is as good as any other
    under uniform routing); with statistics, each layer's most used ones.
    """
    counts = []
    for avail, layers in zip(avail_by_card, moe_layers_by_card):
        if layers:
            # One more expert in each of the card's layers costs their sizes summed (a mix's
            # layers differ when held as stored).
            per_count = sum(bytes_per_expert[layer] for layer in layers)
            counts.append(max(0, math.floor(avail / per_count)) if per_count else n_experts)
    n = min([n_experts, *counts]) if counts else 0
    return top([layer for layers in moe_layers_by_card for layer in layers], n, n_experts, stats)


def top(layers: Sequence[int], n: int, n_experts: int, stats: ExpertStats | None = None) -> dict[int, tuple[int, ...]]:
    """`n` experts of each layer: the lowest ids, or with statistics each layer's most used."""
    return {layer: _top_experts(layer, n, n_experts, stats) for layer in layers}


def deal(gpu_experts: Mapping[int, Sequence[int]], room: Sequence[float],
         bytes_per_expert: Mapping[int, float]) -> list[dict[int, tuple[int, ...]]]:
    """Each layer's GPU experts dealt to the cards under tensor parallelism, in id order: card c
    the next as many as its share.

    Every layer is split in proportion to the cards' `room` (bytes each has for experts),
    rounded down, so each layer's work is shared alike; the few left over go to the cards
    with the most room left, which keeps every card within its room while the cards
    together hold them all."""
    total = sum(room)
    shares = [r / total if total else 1 / len(room) for r in room]
    left = list(room)
    by_card: list[dict[int, tuple[int, ...]]] = [{} for _ in room]
    for layer, ids in gpu_experts.items():
        counts = [math.floor(len(ids) * share) for share in shares]
        for c, n in enumerate(counts):
            left[c] -= n * bytes_per_expert[layer]
        for _ in range(len(ids) - sum(counts)):
            c = max(range(len(left)), key=lambda c: (left[c], -c))
            counts[c] += 1
            left[c] -= bytes_per_expert[layer]
        start = 0
        for c, n in enumerate(counts):
            by_card[c][layer] = tuple(ids[start : start + n])
            start += n
    return by_card


def frequency(
    avail_by_card: Sequence[int],
    moe_layers_by_card: Sequence[Sequence[int]],
    bytes_per_expert: Mapping[int, float],
    stats: ExpertStats,
) -> dict[int, tuple[int, ...]]:
    """The globally most used (layer, expert) pairs first, each on the card owning its layer."""
    card_of = {layer: c for c, layers in enumerate(moe_layers_by_card) for layer in layers}
    left = list(avail_by_card)
    placed: dict[int, list[int]] = {layer: [] for layer in card_of}
    for count, layer, expert in stats.ranked_pairs():
        if layer not in card_of or count == 0:
            continue
        c = card_of[layer]
        if left[c] >= bytes_per_expert[layer]:
            left[c] -= bytes_per_expert[layer]
            placed[layer].append(expert)
    return {layer: tuple(sorted(ids)) for layer, ids in placed.items()}


def _top_experts(layer: int, n: int, n_experts: int, stats: ExpertStats | None) -> tuple[int, ...]:
    counts = stats.layers.get(layer) if stats else None
    if not counts:
        return tuple(range(n))
    ranked = sorted(range(n_experts), key=lambda e: (-counts[e], e))
    return tuple(sorted(ranked[:n]))
