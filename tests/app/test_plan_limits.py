"""`hybridmoe plan` states the engine's limits plainly: how many conversations run at once and
the KV cache they hold together, in the text and in --json."""

from __future__ import annotations

import json
from pathlib import Path

from hybridmoe.app.cli import main

KIMI = Path(__file__).resolve().parents[2] / "assets" / "configs" / "moonshotai__Kimi-K2.6.json"


def test_plan_says_how_many_conversations_run_at_once_and_their_kv_cache(capsys):
    args = ["plan", str(KIMI), "--hardware", "4x RTX PRO 6000", "--users", "4", "--context", "32768"]
    assert main(args) == 0
    text = capsys.readouterr().out
    # 4 x 32,768 tokens x 70,272 B per token (docs/sizing.md §2), over the four cards
    assert ("Conversations at once: 4 (KV cache: 4 × 32,768 tokens, 8.6 GiB, on every card: 34.3 GiB in all); "
            "more wait their turn") in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workload"]["users"] == 4 and plan["workload"]["context"] == 32768
    # Tensor parallel MLA: each of the four cards keeps the latent cache all its heads read.
    assert plan["parallel"] == "tp"
    assert plan["kv_cache_bytes"] == 4 * 4 * 32768 * 70272 == 16 * plan["kv_bytes_per_conversation"]
    assert plan["kv_cache_bytes"] == sum(d["bytes_by_class"]["kv_cache"] for d in plan["devices"])
    assert main([*args, "--parallel", "pp", "--json"]) == 0
    pp = json.loads(capsys.readouterr().out)
    assert pp["kv_cache_bytes"] == 4 * 32768 * 70272 == sum(d["bytes_by_class"]["kv_cache"] for d in pp["devices"])


def test_one_conversation_on_the_cpu_keeps_its_cache_in_host_ram(capsys):
    assert main(["plan", str(KIMI), "--hardware", "cpu-only", "--context", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_bytes"] == 8192 * 70272
    assert main(["plan", str(KIMI), "--hardware", "cpu-only", "--context", "8192"]) == 0
    assert "Conversations at once: 1 (KV cache: 1 × 8,192 tokens, 549.0 MiB)" in capsys.readouterr().out
