"""The steps the stored-form scripts compare (run in processes of their own, run_kernel_check):
a prompt's last logits, then greedy tokens fed back one at a time."""

from __future__ import annotations

import torch


def prompt_then_greedy(model, prompt: torch.Tensor, steps: int = 4) -> tuple[list[int], torch.Tensor]:
    """The greedy tokens after `prompt` [1, T] and the logits before each ([steps + 1, V] on the CPU):
    the prompt's call first, then one decode call a token."""
    logits = model(prompt, 0, last_only=True)
    pos, tokens, rows = prompt.shape[-1], [], [logits[0, -1].float().cpu()]
    for _ in range(steps):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[tokens[-1]]], device=prompt.device), pos)
        rows.append(logits[0, -1].float().cpu())
        pos += 1
    return tokens, torch.stack(rows)


def max_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest reference value."""
    return float((got - want).abs().max() / want.abs().max())
