"""The command line as a user runs it: the installed `hybridmoe` script, its output and exit codes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
KIMI = CONFIGS / "moonshotai__Kimi-K2.6.json"


def run(*args, env=None, input=None, timeout=120):
    exe = shutil.which("hybridmoe")
    cmd = [exe] if exe else [sys.executable, "-m", "hybridmoe.app.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, input=input, timeout=timeout)


@pytest.fixture
def home(tmp_path):
    """Config, data and state directories of their own, so tests never touch the user's."""
    env = dict(os.environ)
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        env[var] = str(tmp_path / var.lower())
    env["HF_HOME"] = str(tmp_path / "hf")
    return env


def assert_clean_error(result, code):
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(("hybridmoe: error:", "usage:")), result.stderr


def test_doctor_json_has_the_documented_keys(home):
    r = run("doctor", "--json", "--no-bandwidth", env=home)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["cpu"]["physical_cores"] >= 1
    assert d["cpu"]["threads"] >= d["cpu"]["physical_cores"]
    assert all(f == f.lower() for f in d["cpu"]["features"])
    assert d["memory"]["total_bytes"] > 0 and d["memory"]["available_bytes"] > 0
    assert isinstance(d["gpus"], list)
    for g in d["gpus"]:
        assert {"name", "total_bytes", "free_bytes", "compute_capability"} <= set(g)
    assert "disk" in d and "unknown" in d
    assert d["cpu_kernels"]["isa"] in ("avx512_amx", "avx512_vnni", "avx2", "scalar")  # the extension is built here


def test_doctor_text_names_the_sections(home):
    r = run("doctor", "--no-bandwidth", env=home)
    assert r.returncode == 0, r.stderr
    for section in ("CPU", "Memory", "GPUs"):
        assert f"\n{section}\n" in f"\n{r.stdout}"
    kernels = next(line for line in r.stdout.splitlines() if line.strip().startswith("CPU kernels"))
    assert any(name in kernels for name in ("avx512_amx", "avx512_vnni", "avx2", "scalar")) and "threads" in kernels


def test_plan_kimi_on_a_preset_prints_checkable_figures(home):
    r = run("plan", KIMI, "--hardware", "4x H200 NVL", "--context", "32768", env=home)
    assert r.returncode == 0, r.stderr
    assert "24.77 MB" in r.stdout  # per expert, docs/sizing.md §1
    assert "70,272 B" in r.stdout  # KV per token, docs/sizing.md §2
    assert "llama-server" in r.stdout
    assert "Fits: yes" in r.stdout


def test_the_worked_example_in_docs_is_what_plan_prints(home):
    """docs/sizing.md quotes `plan` on Kimi K2.6 with four users; the quote stays the output."""
    doc = (CONFIGS.parents[1] / "docs" / "sizing.md").read_text()
    command = "hybridmoe plan assets/configs/moonshotai__Kimi-K2.6.json --hardware \"4x RTX PRO 6000\" --context 32768 --users 4"
    assert command in doc
    after = doc[doc.index(command):]
    quoted = after.split("```\n", 2)[2].split("\n```", 1)[0]  # the block after the command's own
    r = run("plan", KIMI, "--hardware", "4x RTX PRO 6000", "--context", "32768", "--users", "4", env=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == quoted


def test_plan_json_and_save(home, tmp_path):
    saved = tmp_path / "kimi-plan.toml"
    r = run("plan", KIMI, "--hardware", "8x RTX PRO 6000", "--json", "--save", saved, env=home)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("kv_bytes_per_token", "routed_expert_bytes_total", "gpu_routed_expert_bytes",
                "host_routed_expert_bytes", "host_bytes_per_token", "decode_tokens_per_s_upper_bound",
                "devices", "llama_cpp", "fits", "reason"):
        assert key in d, key
    assert {"name", "budget_bytes", "used_bytes"} <= set(d["devices"][0])
    assert saved.exists()
    from hybridmoe.backend.plan import Plan

    # The decode path is worked out from the plan when it is shown, not saved with it.
    assert d.pop("decode_path")["executor"]
    assert json.loads(json.dumps(Plan.load(saved).to_dict())) == d


def test_a_plan_that_does_not_fit_exits_zero_with_fits_false(home):
    r = run("plan", KIMI, "--hardware", "cpu-only", "--ram", "128GiB", "--json", env=home)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is False and "short by" in d["reason"]


def test_overrides_describe_a_machine_to_buy(home):
    r = run("plan", KIMI, "--hardware", "cpu-only", "--ram", "1.5TB", "--host-bandwidth", "1229GB/s", "--json",
            env=home)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["host_bandwidth_bytes_per_s"] == pytest.approx(1229e9)
    assert d["described_hardware"] is True


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["plan", KIMI, "--gpus", "0", "--gpu-memory", "96GiB", "--hardware", "cpu-only"], 2, "0 GPUs"),
        (["plan", KIMI, "--hardware", "cpu-only", "--ram=-5GiB"], 2, "negative"),
        (["plan", KIMI, "--hardware", "cpu-only", "--ram", "lots"], 2, "cannot read"),
        (["plan", KIMI, "--hardware", "3x Imaginary 9000"], 2, "4x H200 NVL"),
        (["plan", KIMI, "--users", "0"], 2, "must be 1 or more"),
        (["plan", KIMI, "--hardware", "cpu-only", "--context", "99999999"], 1, "longer than"),
        (["plan", KIMI, "--strategy", "frequency", "--hardware", "cpu-only"], 2, "--stats"),
        (["plan", "/nonexistent/model"], 1, "/nonexistent/model"),
        (["inspect", "/nonexistent/model.gguf"], 1, "/nonexistent/model.gguf"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_bad_input_gets_one_clear_message(home, args, code, needle):
    r = run(*args, env=home)
    assert_clean_error(r, code)
    assert needle in r.stderr


def test_malformed_hardware_file(home, tmp_path):
    bad = tmp_path / "box.toml"
    bad.write_text('gpu_count = 2\ngpu_memory = "96GiB"\nram = [\n')
    r = run("plan", KIMI, "--hardware", bad, env=home)
    assert_clean_error(r, 2)
    assert str(bad) in r.stderr


def test_corrupt_config_json(home, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": ')
    r = run("inspect", bad, env=home)
    assert_clean_error(r, 1)
    assert "config.json" in r.stderr


def test_unknown_architecture_names_the_supported_ones(home, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}))
    r = run("plan", cfg, "--hardware", "cpu-only", env=home)
    assert_clean_error(r, 1)
    assert "DeepseekV3ForCausalLM" in r.stderr or "deepseek" in r.stderr.lower()


def test_internal_errors_are_logged_not_shown(home, monkeypatch, capsys):
    """A bug prints one line and the path of the log; the traceback goes to the log."""
    from hybridmoe.app import cli

    monkeypatch.setenv("XDG_STATE_HOME", home["XDG_STATE_HOME"])

    def boom(args):
        raise RuntimeError("kaboom")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["doctor"].set_defaults(func=boom)
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: kaboom" in err and "Traceback" not in err
    log = Path(home["XDG_STATE_HOME"]) / "hybridmoe" / "errors.log"
    assert "Traceback" in log.read_text()


# ---- unreadable, looping and incomplete models; contexts beyond the model ---------------------


def _without_root_privileges() -> list[str] | None:
    """A command prefix under which chmod 000 denies reads: none needed for a normal user;
    for root (as tests run here), root without its capabilities to override file
    permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH). None when neither is possible."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_an_unreadable_model_folder_says_permission_denied(home, tmp_path):
    prefix = _without_root_privileges()
    if prefix is None:
        pytest.skip("running as root without setpriv: permissions cannot be denied here")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(KIMI, model / "config.json")
    exe = shutil.which("hybridmoe")
    cli = [exe] if exe else [sys.executable, "-m", "hybridmoe.app.cli"]
    model.chmod(0)
    try:
        for args in (["inspect", model], ["plan", model, "--hardware", "cpu-only"]):
            r = subprocess.run([*prefix, *cli, *map(str, args)], capture_output=True, text=True, env=home, timeout=120)
            assert_clean_error(r, 1)
            assert "internal error" not in r.stderr
            assert f"Cannot read {model}: permission denied" in r.stderr
    finally:
        model.chmod(0o755)


def test_symbolic_links_that_lead_nowhere_are_named(home, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    for args in (["inspect", loop], ["plan", loop], ["run", "-m", loop, "-p", "hello"]):
        r = run(*args, env=home)
        assert_clean_error(r, 1)
        assert f"{loop} is a loop of symbolic links" in r.stderr
    r = run("inspect", dangling, env=home)
    assert_clean_error(r, 1)
    assert f"{dangling} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in r.stderr


def test_a_context_beyond_the_model_is_refused_alike_by_plan_and_run(home, tmp_path):
    """`run` once lowered an explicit --context silently while `plan` refused it."""
    too_long = str(10**9)
    planned = run("plan", KIMI, "--hardware", "cpu-only", "--context", too_long, env=home)
    ran = run("run", "-m", KIMI, "-p", "hello", "--context", too_long, env=home)
    for r in (planned, ran):
        assert_clean_error(r, 1)
        assert f"context {too_long} is longer than" in r.stderr and "--context 262144 or less" in r.stderr

    # Not asked for, the default context is kept within the model's, by both.
    small = tmp_path / "config.json"
    config = json.loads(KIMI.read_text())
    config["text_config"]["max_position_embeddings"] = 8192
    small.write_text(json.dumps(config))
    r = run("plan", small, "--hardware", "cpu-only", "--json", env=home)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["workload"]["context"] == 8192


def test_a_checkpoint_missing_a_tensor_is_refused_by_inspect_and_plan(home, tmp_path, tiny_chat_model):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    assert run("inspect", model, env=home).returncode == 0  # complete, it inspects
    lost = "model.layers.1.self_attn.k_proj.weight"
    for shard in model.glob("*.safetensors"):
        tensors = load_file(shard)
        if tensors.pop(lost, None) is not None:
            save_file(tensors, shard, metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        del data["weight_map"][lost]
        index.write_text(json.dumps(data))
    for args in (["inspect", model], ["plan", model, "--hardware", "cpu-only"]):
        r = run(*args, env=home)
        assert_clean_error(r, 1)
        assert f"lacks tensor '{lost}'" in r.stderr and str(model) in r.stderr
