"""`pull` against the fake Hub: what is downloaded, progress, resume, verification, errors."""

from __future__ import annotations

import hashlib
import itertools
from collections import namedtuple
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir

from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.hub import DownloadProgress, fetch, plan_pull, pull
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.session import Cancelled, CancelToken, Progress
from tests.hub.conftest import JUNK, gguf_repo_files

SHARD1 = "model-00001-of-00002.safetensors"


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(fetch, "RETRY_DELAY_S", 0.0)


@pytest.fixture
def tiny(hub, checkpoint_files):
    hub.add_repo("org/tiny", {**checkpoint_files, **JUNK})
    return hub


@pytest.fixture
def tiny_gguf(hub, gguf_bytes):
    hub.add_repo("org/tiny-GGUF", gguf_repo_files(gguf_bytes))
    return hub


def snapshot_files(model) -> set[str]:
    root = model.path if model.kind == "safetensors" else model.path.parent.parent
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def incomplete_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.incomplete"))


# ---- what is downloaded --------------------------------------------------------------------------


def test_safetensors_pull_takes_only_what_the_engine_reads(tiny, cache_dir, checkpoint_files):
    model = pull("org/tiny")
    assert model.kind == "safetensors" and model.family == "mixtral" and model.usable
    assert snapshot_files(model) == set(checkpoint_files)  # config, tokenizer, template, shards, index
    assert model.size_bytes == sum(len(b) for b in checkpoint_files.values())
    for junk in JUNK:  # never even asked for
        assert not tiny.data_requests(junk), junk
    for name, data in checkpoint_files.items():
        assert (model.path / name).read_bytes() == data
    inspected = inspect_model(model.path)
    assert inspected.kind == "safetensors" and len(inspected.files) == 2
    # A cache huggingface-hub itself reads as healthy, with "main" recorded.
    info = scan_cache_dir(cache_dir)
    assert not info.warnings and not info.incomplete_files
    (repo,) = info.repos
    (rev,) = repo.revisions
    assert rev.refs == frozenset({"main"}) and rev.commit_hash == model.revision


def test_progress_is_for_the_whole_pull(tiny, checkpoint_files):
    events: list[Progress] = []
    pull("org/tiny", on_progress=events.append)
    assert events and all(isinstance(e, DownloadProgress) and e.stage == "download" and e.unit == "B" for e in events)
    total = sum(len(b) for b in checkpoint_files.values())
    assert {e.total for e in events} == {total}
    assert events[-1].done == total and events[-1].files_done == events[-1].files_total == len(checkpoint_files)
    assert events[-1].eta_s == 0
    assert all(a.done <= b.done for a, b in itertools.pairwise(events))
    assert "of 185.9 KiB" in events[-1].message


def test_second_pull_downloads_nothing(tiny):
    first = pull("org/tiny")
    before = len(tiny.requests)
    second = pull("org/tiny")
    assert second.path == first.path
    new = tiny.requests[before:]
    assert [r.path.split("?")[0] for r in new if "/api/models/" in r.path] == ["/api/models/org/tiny/revision/main"]
    assert not [r for r in new if r.method == "GET" and "/api/" not in r.path]


def test_gguf_pull_takes_one_quantization_by_name(tiny_gguf, gguf_bytes):
    plans = []
    model = pull("org/tiny-GGUF", quant="q4_k_m", on_plan=plans.append)  # any case
    n = int(gguf_bytes["n_parts"])
    expected = [f"Q4_K_M/tiny-Q4_K_M-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]
    assert [f.path for f in plans[0].files] == expected
    assert model.kind == "gguf" and model.quantization == "Q4_K_M" and model.family == "qwen3_moe"
    assert model.path.name == f"tiny-Q4_K_M-00001-of-{n:05d}.gguf"  # the first part: what inspect takes
    assert model.name == "org/tiny-GGUF:Q4_K_M"
    assert sorted(snapshot_files(model)) == expected
    assert not tiny_gguf.data_requests("tiny-Q8_0.gguf") and not tiny_gguf.data_requests("tiny-Q2_K.gguf")
    assert inspect_model(model.path).kind == "gguf"


def test_gguf_single_file_quantization(tiny_gguf, gguf_bytes):
    model = pull("org/tiny-GGUF", quant="Q8_0")
    assert model.path.name == "tiny-Q8_0.gguf" and model.path.read_bytes() == gguf_bytes["single"]
    assert model.files == (model.path,)


def test_gguf_repo_without_quant_lists_the_choices_with_sizes(tiny_gguf):
    with pytest.raises(UsageError) as err:
        pull("org/tiny-GGUF")
    text = str(err.value)
    for label in ("Q2_K", "Q4_K_M", "Q8_0"):
        assert label in text
    assert "2 files" in text and "KiB" in text and "mmproj" not in text and "--quant" in text
    assert not [r for r in tiny_gguf.requests if r.method == "GET" and "/api/" not in r.path]


def test_unknown_quantization_lists_those_there_are(tiny_gguf):
    with pytest.raises(UsageError) as err:
        pull("org/tiny-GGUF", quant="Q5_K_M")
    assert "has no Q5_K_M" in str(err.value) and "Q4_K_M" in str(err.value) and "Q8_0" in str(err.value)


def test_quant_on_a_safetensors_repo_is_a_usage_error(hub, checkpoint_files):
    hub.add_repo("org/plain", checkpoint_files)
    with pytest.raises(UsageError, match="without GGUF files"):
        pull("org/plain", quant="Q4_K_M")


def test_the_plan_comes_before_any_byte(tiny, checkpoint_files):
    seen = []

    def on_plan(plan):
        seen.append(plan)
        assert not [r for r in tiny.requests if r.method == "GET" and "/api/" not in r.path]

    pull("org/tiny", on_plan=on_plan)
    plan = seen[0]
    assert {f.path: f.size for f in plan.files} == {k: len(v) for k, v in checkpoint_files.items()}
    assert plan.total_bytes == plan.download_bytes and plan.present_bytes == 0
    shard = next(f for f in plan.files if f.path == SHARD1)
    assert shard.sha256 == hashlib.sha256(checkpoint_files[SHARD1]).hexdigest()


# ---- interrupted transfers -----------------------------------------------------------------------


def test_a_cut_transfer_resumes_with_a_range_request(tiny, checkpoint_files, cache_dir):
    tiny.file("org/tiny", SHARD1).faults = [("cut", 20_000)]
    model = pull("org/tiny")
    assert (model.path / SHARD1).read_bytes() == checkpoint_files[SHARD1]
    gets = tiny.data_requests(SHARD1)
    assert [g.range for g in gets] == [None, "bytes=20000-"]
    assert not incomplete_files(cache_dir)


def test_an_interrupted_pull_resumes_where_it_stopped(tiny, checkpoint_files, cache_dir):
    # The connection breaks after 30 kB, then the CDN refuses (403 twice, even after the
    # link is renewed): the pull fails, the partial file stays.
    tiny.file("org/tiny", SHARD1).faults = [("cut", 30_000), ("status", 403), ("status", 403), ("status", 403),
                                            ("status", 403), ("status", 403), ("status", 403)]
    with pytest.raises(ModelError) as err:
        pull("org/tiny", max_workers=1)
    assert "403" in str(err.value)
    (partial,) = incomplete_files(cache_dir)
    assert partial.stat().st_size == 30_000
    assert partial.read_bytes() == checkpoint_files[SHARD1][:30_000]
    tiny.file("org/tiny", SHARD1).faults = []

    seen = []
    model = pull("org/tiny", on_plan=seen.append)
    assert seen[0].present_bytes >= 30_000  # counted as already there, so not needed on disk again
    assert tiny.data_requests(SHARD1)[-1].range == "bytes=30000-"
    assert (model.path / SHARD1).read_bytes() == checkpoint_files[SHARD1]
    assert not incomplete_files(cache_dir)


def test_cancel_stops_between_chunks_and_a_later_pull_resumes(tiny, checkpoint_files, cache_dir):
    tiny.file("org/tiny", SHARD1).rate = 400_000  # ~0.25 s for the shard: time to cancel in the middle
    cancel = CancelToken()

    def on_progress(p):
        if p.file == SHARD1 and p.done > 30_000:
            cancel.cancel()

    with pytest.raises(Cancelled) as err:
        pull("org/tiny", on_progress=on_progress, cancel=cancel, max_workers=1)
    assert err.value.exit_code == 130 and "resume" in str(err.value)
    (partial,) = incomplete_files(cache_dir)
    have = partial.stat().st_size
    assert 0 < have < len(checkpoint_files[SHARD1])
    tiny.file("org/tiny", SHARD1).rate = None

    model = pull("org/tiny")
    assert tiny.data_requests(SHARD1)[-1].range == f"bytes={have}-"
    assert (model.path / SHARD1).read_bytes() == checkpoint_files[SHARD1]


# ---- verification ----------------------------------------------------------------------------------


def test_a_corrupt_file_is_deleted_not_cached(tiny, cache_dir):
    tiny.file("org/tiny", SHARD1).corrupt = True
    with pytest.raises(ModelError) as err:
        pull("org/tiny")
    assert "corrupt" in str(err.value) and "sha256" in str(err.value) and SHARD1 in str(err.value)
    sha = hashlib.sha256(tiny.file("org/tiny", SHARD1).data).hexdigest()
    assert not list((cache_dir / "models--org--tiny" / "blobs").glob(f"{sha}*"))
    assert not list(cache_dir.rglob(SHARD1))


def test_a_corrupt_small_file_fails_its_git_hash(tiny, cache_dir):
    tiny.file("org/tiny", "config.json").corrupt = True
    with pytest.raises(ModelError, match="git blob id"):
        pull("org/tiny")
    assert not list(cache_dir.rglob("config.json"))


def test_a_size_the_listing_does_not_match_is_refused(tiny, cache_dir, checkpoint_files):
    tiny.file("org/tiny", SHARD1).listed_size = len(checkpoint_files[SHARD1]) + 10
    with pytest.raises(ModelError, match="lists .* bytes but serves"):
        pull("org/tiny")
    assert not list(cache_dir.rglob(SHARD1))


def test_an_answer_shorter_than_the_file_is_resumed_not_accepted(tiny, checkpoint_files):
    tiny.file("org/tiny", SHARD1).faults = [("short", 10_000)]
    model = pull("org/tiny")
    assert (model.path / SHARD1).read_bytes() == checkpoint_files[SHARD1]
    assert tiny.data_requests(SHARD1)[-1].range == "bytes=10000-"


def test_a_garbage_partial_file_is_downloaded_again(tiny, checkpoint_files, cache_dir):
    data = checkpoint_files[SHARD1]
    sha = hashlib.sha256(data).hexdigest()
    blobs = cache_dir / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.incomplete").write_bytes(b"\xff" * 5000)  # left by something else, wrong
    model = pull("org/tiny")
    assert (model.path / SHARD1).read_bytes() == data
    assert [g.range for g in tiny.data_requests(SHARD1)] == ["bytes=5000-", None]


# ---- the Hub says no -------------------------------------------------------------------------------


def test_unknown_repo(hub):
    with pytest.raises(ModelError) as err:
        pull("org/does-not-exist")
    assert "org/does-not-exist was not found" in err.value.what and "HF_TOKEN" in err.value.hint
    assert err.value.exit_code == 1


def test_unknown_revision(tiny):
    with pytest.raises(ModelError, match="no revision 'v9'"):
        pull("org/tiny", revision="v9")


def test_not_a_repo_id(hub):
    with pytest.raises(UsageError, match="not a Hugging Face repository id"):
        pull("not a repo")


def test_gated_repo_needs_the_license_and_a_token(hub, checkpoint_files, monkeypatch, cache_dir):
    hub.add_repo("org/gated", checkpoint_files, gated=True)
    with pytest.raises(ModelError) as err:
        pull("org/gated")
    text = str(err.value)
    assert "gated" in text and "license" in text and "HF_TOKEN" in text and "hf auth login" in text
    assert not list(cache_dir.rglob("*.safetensors"))

    monkeypatch.setenv("HF_TOKEN", "hf_not_allowed")
    with pytest.raises(ModelError, match="gated"):
        pull("org/gated")

    monkeypatch.setenv("HF_TOKEN", "hf_good")
    assert pull("org/gated").usable
    # The token went to the Hub, never to the CDN.
    assert any(r.authorization == "Bearer hf_good" for r in hub.requests if r.server == "hub")
    assert all(r.authorization is None for r in hub.requests if r.server == "cdn")


def test_private_repo_without_token_reads_as_not_found(hub, checkpoint_files):
    hub.add_repo("org/private", checkpoint_files, private=True)
    with pytest.raises(ModelError) as err:
        pull("org/private")
    assert "not found" in err.value.what and "private" in err.value.hint and "HF_TOKEN" in err.value.hint


def test_not_enough_disk_space_is_refused_before_any_byte(tiny, monkeypatch, checkpoint_files):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10 << 30, 10 << 30, 100_000))
    plans = []
    with pytest.raises(ModelError) as err:
        pull("org/tiny", on_plan=plans.append)
    text = str(err.value)
    assert "Not enough disk space for org/tiny" in text
    assert "185.9 KiB" in text and "97.7 KiB free" in text and "1.0 GiB margin" in text
    assert "HF_HOME" in text
    assert plans and not [r for r in tiny.requests if r.method == "GET" and "/api/" not in r.path]


# ---- offline ---------------------------------------------------------------------------------------


def test_offline_mode_uses_the_cached_copy(tiny, monkeypatch):
    online = pull("org/tiny")
    before = len(tiny.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = pull("org/tiny")
    assert offline.path == online.path and offline.usable
    assert "offline" in offline.note and "HF_HUB_OFFLINE" in offline.note
    assert len(tiny.requests) == before  # not one request


def test_unreachable_hub_uses_the_cached_copy(tiny, monkeypatch):
    pull("org/tiny")
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    model = pull("org/tiny")
    assert "cannot reach" in model.note and model.usable


def test_offline_without_a_cached_copy_is_a_clear_error(home, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError) as err:
        pull("org/never-downloaded")
    assert "the Hub cannot be reached" in err.value.what and "holds no copy" in err.value.what
    assert "HF_HUB_OFFLINE" in err.value.hint


def test_an_unreachable_hub_without_a_cached_copy_names_no_offline_switch(home, monkeypatch):
    """HF_HUB_OFFLINE was never set: the message must not tell to unset it."""
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(ModelError) as err:
        pull("org/never-downloaded")
    assert "cannot reach" in err.value.what and "holds no copy" in err.value.what
    assert "HF_HUB_OFFLINE" not in err.value.hint and "Connect to the network" in err.value.hint


def test_offline_with_an_incomplete_cached_copy_says_what_is_missing(tiny, monkeypatch):
    model = pull("org/tiny")
    (model.path / SHARD1).unlink()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match=f"incomplete.*{SHARD1}"):
        pull("org/tiny")


def test_offline_gguf_quantization_from_the_cache(tiny_gguf, monkeypatch):
    pull("org/tiny-GGUF", quant="Q4_K_M")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert pull("org/tiny-GGUF", quant="q4_k_m").quantization == "Q4_K_M"
    with pytest.raises(UsageError, match="has no Q8_0"):  # only what was downloaded is there
        pull("org/tiny-GGUF", quant="Q8_0")


def test_plan_pull_counts_what_is_already_there(tiny, checkpoint_files):
    pull("org/tiny")
    plan = plan_pull("org/tiny")
    assert plan.present_bytes == plan.total_bytes and plan.download_bytes == 0
