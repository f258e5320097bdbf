"""The site cache's model mirror as the deploy sets it up: olah installed from gpufleet's lock of hashed wheels
(the sandbox's index of them), with the config the deploy writes, behind the site cache's nginx front, mirroring
the stand-in hub; driven by the real huggingface_hub. What docs/site-cache.md says olah was picked for: it runs
against an upstream of our choosing, serves only the allowed repositories, answers `resolve` with the headers the
client needs and byte ranges, never redirects the client to the hub, and fetches each file from the hub once."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi, HfFileSystem, snapshot_download  # noqa: E402

from gpufleet.sandbox import hub as standin  # noqa: E402
from gpufleet.sandbox import router_index  # noqa: E402
from gpufleet.sandbox.image import MODEL_REPO, write_tiny_model  # noqa: E402
from gpufleet.sitecache import mirror  # noqa: E402
from gpufleet.sitecache import operations as site_cache  # noqa: E402
from gpufleet.vllm import weights  # noqa: E402

SHARD = "model-00002-of-00002.safetensors"
OTHER = "someone/else"

pytestmark = pytest.mark.skipif(not shutil.which("nginx"), reason="no nginx on this machine")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_answering(url: str, proc: subprocess.Popen[Any], what: str) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer")


@pytest.fixture(scope="module")
def olah_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """olah from the lock's wheels for this machine's Python (the test hosts' 3.11 entry when it is 3.11), as the
    deploy's install script installs it: --require-hashes, --no-deps, wheels only."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = mirror.locked("test", python, router_index.MACHINE)
    index = router_index.ensure_lock_index(
        router_index.CACHE_DIR / f"mirror-index-{mirror.OLAH_VERSION}-py{python}-{install.key[:12]}", install
    )
    venv = tmp_path_factory.mktemp("olah") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / mirror.REQUIREMENTS).write_text(install.requirements())
    script = mirror.install_script(install, (index / "simple").as_uri()).replace(mirror.venv_dir(install), str(venv))
    script = script.split(" && printf")[0]  # the marker and the switch are the host's
    subprocess.run(["sh", "-c", script], check=True, timeout=600)
    return venv


@pytest.fixture
def site(olah_venv: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The stand-in hub (the tiny model and a 4 MiB shard, and another repo), olah mirroring only the tiny model
    behind the front door: {"front": endpoint, "olah": its own endpoint, "hub", "hub_log", "commit", "root",
    "state"}."""
    model = tmp_path / "tiny"
    write_tiny_model(model)
    files: dict[str, bytes | Path] = {p.name: p for p in model.iterdir()}
    files[SHARD] = os.urandom(4 << 20)
    root, log = tmp_path / "hub", tmp_path / "hub.log"
    commit = standin.publish(root, MODEL_REPO, files)
    standin.publish(root, OTHER, {"config.json": b"{}"})
    httpd = standin.server(root, "127.0.0.1", 0, log)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    olah_port, front_port = free_port(), free_port()
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "olah.toml"
    config.write_text(
        mirror.render_config(
            f"http://127.0.0.1:{httpd.server_address[1]}",
            olah_port,
            f"127.0.0.1:{front_port}",
            [MODEL_REPO],
            1,
            state=str(state),
        )
    )
    olah = subprocess.Popen(
        [str(olah_venv / "bin" / "olah-cli"), "-c", str(config)],
        cwd=state,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    conf = tmp_path / "nginx.conf"
    front = site_cache.render_front(
        front_port, free_port(), ["127.0.0.1"], ["vllm/vllm-openai"], [MODEL_REPO], olah_port
    )
    conf.write_text(
        f"daemon off; pid {tmp_path}/nginx.pid; error_log stderr; events {{}} http {{ access_log off; {front} }}"
    )
    nginx = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_answering(f"http://127.0.0.1:{olah_port}/api/models/{MODEL_REPO}", olah, "olah")
        wait_answering(f"http://127.0.0.1:{front_port}/", nginx, "nginx")
        yield {
            "front": f"http://127.0.0.1:{front_port}",
            "olah": f"http://127.0.0.1:{olah_port}",
            "hub_log": log,
            "hub": f"http://127.0.0.1:{httpd.server_address[1]}",
            "commit": commit,
            "root": root,
            "state": state,
        }
    finally:
        for proc in (nginx, olah):
            proc.terminate()
            proc.wait(20)
        httpd.shutdown()
        httpd.server_close()


def served(site: dict[str, Any], since: int = 0) -> int:
    return sum(standin.served_bytes(site["hub_log"], since).values())


def test_two_hosts_download_through_the_mirror_and_the_hub_serves_each_file_once(site, tmp_path: Path):
    front, commit = site["front"], site["commit"]
    model_bytes = sum(f.stat().st_size for f in (site["root"] / MODEL_REPO / "commits" / commit).iterdir())
    snapshot_download(MODEL_REPO, local_dir=tmp_path / "host1", endpoint=front)
    assert served(site) == model_bytes
    offset = site["hub_log"].stat().st_size
    snapshot_download(MODEL_REPO, local_dir=tmp_path / "host2", endpoint=front)
    assert served(site, offset) == 0  # the second host's bytes all came from the site
    # Checked against the hub itself, never against what the mirror says.
    for host in ("host1", "host2"):
        result = HfApi(endpoint=site["hub"]).verify_repo_checksums(
            MODEL_REPO, revision=commit, local_dir=tmp_path / host
        )
        assert result.checked_count == 6 and not result.mismatches
    # What olah fetched, it kept (a restart of it fetches nothing again).
    assert list((site["state"] / "repos").rglob("block_*.bin"))


def test_resolve_answers_in_place_with_the_clients_headers_and_byte_ranges(site):
    front, commit = site["front"], site["commit"]
    url = f"{front}/{MODEL_REPO}/resolve/main/{SHARD}"
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.build_opener(NoRedirect).open(request) as resp:
        assert resp.status == 200  # no redirect to the hub: the file itself
        shard = (site["root"] / MODEL_REPO / "commits" / commit / SHARD).read_bytes()
        assert resp.headers["X-Repo-Commit"] == commit
        assert resp.headers["ETag"].strip('"') == standin.describe(SHARD, shard).sha256
        assert int(resp.headers["Content-Length"]) == len(shard)
    fs = HfFileSystem(endpoint=front)
    with fs.open(f"{MODEL_REPO}/{SHARD}", "rb", revision=commit, block_size=5000, cache_type="none") as f:
        f.seek(1000)
        assert f.read(5000) == shard[1000:6000]


def test_only_the_inventorys_repositories_pass(site):
    for base, code in ((site["front"], 403), (site["olah"], 401)):  # nginx's fence, then olah's own allow-list
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/models/{OTHER}/revision/main")
        assert refused.value.code == code
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(
            urllib.request.Request(
                f"{site['front']}/api/models/{MODEL_REPO}/paths-info/main", data=b"paths=config.json"
            )
        )
    assert refused.value.code == 403


def test_a_block_tampered_in_the_mirrors_storage_is_caught_by_the_hubs_sha256(site, tmp_path: Path):
    """olah checks its blocks with CRC32s it stores beside them: a tamperer who rewrites both gets the bad bytes
    served. The hub's sha256 (gpufleet.vllm.weights) is what catches them."""
    front, commit = site["front"], site["commit"]
    snapshot_download(MODEL_REPO, local_dir=tmp_path / "first", endpoint=front)
    stored = next(p for p in (site["state"] / "repos").rglob("block_00000000.bin") if SHARD in str(p))
    data = bytearray(stored.read_bytes())
    data[100:108] = b"TAMPERED"
    stored.write_bytes(bytes(data))
    crc = stored.parent.parent / "chunks.crc"
    crcs = bytearray(crc.read_bytes())
    crcs[0:4] = (zlib.crc32(bytes(data[: 1 << 20])) & 0xFFFFFFFF).to_bytes(4, "little")
    crc.write_bytes(bytes(crcs))
    snapshot_download(MODEL_REPO, local_dir=tmp_path / "second", endpoint=front)
    with urllib.request.urlopen(weights.info_url(site["hub"], MODEL_REPO, commit)) as answer:
        revision = weights.parse_info(MODEL_REPO, answer.read().decode())
    out = subprocess.run(
        ["sh", "-c", weights.hash_command(str(tmp_path / "second"), revision.files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert weights.mismatches(revision, out) == [SHARD]


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None
