"""One download per site (docs/site-cache.md), on three fresh test hosts of the session fleet: the first also the
site cache (inventory group `site_cache`), the fleet's registry the "upstream", the stand-in nightlies carrying
100 MiB of incompressible bytes each. Steps in file order (each builds on the one before):

1. a rollout's prepare of nightly-1 on all three (the cache host alone, then the other two): the upstream serves
   the big layer once (the cache), each host's record says its layers came from the site; every host lists the
   image under the upstream name only; the cache serves nothing but the inventory's repositories by digest to the
   inventory's hosts (this machine, another repository, a tag, a push: refused); its setup converges to no change;
2. the cache host off the network: a prepare of nightly-2 on the other two still succeeds, from upstream, with one
   warning line per host naming the cache; a host told not to use the cache drops it from insecure-registries;
3. a blob of nightly-1 tampered with in the cache's storage: a host pulling nightly-1 again has docker refuse it,
   then pulls from upstream, with one warning line naming the refusal;
4. the cache's bound: a bound the disk cannot hold is refused at preflight; a cache over its bound is emptied
   before the cache host's pull.

The model rides the same prepares (the stand-in hub's tiny model, mirrored by olah on the cache host): step 1's
costs the hub the model's bytes once, all fetched by the mirror; in step 2 two hosts without the model download it
from the hub, each with one warning; a block tampered with in the mirror's storage is refused by the hub's sha256,
fetched again from the hub, never served; a branch moved on the hub changes no host until a run asks for the new
commit (gpufleet_model_sha, what a rollout passes): its prepare downloads it while the old version serves, and the
swap's converge downloads nothing.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpufleet.facts.pull import PullStats
from gpufleet.rollout.prepare import prepare, pull_order
from gpufleet.sandbox import hub as standin_hub
from gpufleet.sandbox import image as sandbox_image
from gpufleet.sandbox import registry as sandbox_registry
from gpufleet.sandbox import services
from gpufleet.sandbox.config import H200x3
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.inventory import inventory_document, write_pyinfra_inventory
from gpufleet.vllm.operations.image import pull_stats_file
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.weights import MARKER
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.pyinfra_run import run_deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploys" / "qwen35.py"
SERVICE = "vllm-qwen35"
CACHE_PORT = 5001
STORAGE = "/var/lib/docker-registry/docker/registry/v2/blobs/sha256"


@pytest.fixture(scope="module")
def site(fleet: Fleet, _fresh_numbers, tmp_path_factory: pytest.TempPathFactory):
    first = next(_fresh_numbers)
    next(_fresh_numbers), next(_fresh_numbers)
    hosts = fleet.add_hosts([H200x3] * 3, first=first)
    try:
        yield from _site(fleet, hosts, tmp_path_factory)
    finally:
        fleet.remove_hosts([h.name for h in hosts])


def _site(fleet: Fleet, hosts: list[Host], tmp_path_factory: pytest.TempPathFactory):
    refs = sandbox_registry.ensure_nightlies(fleet.cfg)
    doc = inventory_document(fleet.cfg, hosts, fleet.key, site_cache=(hosts[0].name,))
    path = tmp_path_factory.mktemp("site") / "inventory.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    inventory = write_pyinfra_inventory(path, path.with_name("site_cache.py"))
    yield fleet, hosts, refs, inventory, path.with_name("prepare.log")


MODEL = sandbox_image.MODEL_REPO
MODEL_DIR = f"{merged_settings({})['vllm_models_dir']}/{merged_settings({})['vllm_model']}"
MIRROR_STORAGE = "/var/lib/gpufleet-model-mirror/repos/files/models"
DOWNLOAD = "Download the model's commit unless it is here and checked"  # the deploy's operation


def hub_commit(fleet: Fleet) -> str:
    return (services.hub_root(fleet.cfg) / MODEL / "refs" / "main").read_text().strip()


def hub_bytes(fleet: Fleet, since: int) -> dict[str, int]:
    return standin_hub.served_bytes(services.hub_log(fleet.cfg), since)


def hub_offset(fleet: Fleet) -> int:
    log = services.hub_log(fleet.cfg)
    return log.stat().st_size if log.exists() else 0


def model_size(fleet: Fleet, commit: str) -> int:
    return sum(f.size for f in standin_hub.listing(services.hub_root(fleet.cfg), MODEL, commit))


def checked(fleet: Fleet, host: Host) -> str:
    """The model commit the host's model directory was checked at (its mark), "" without one."""
    return fleet.run_in(host, f"cat {MODEL_DIR}/{MARKER} 2>/dev/null", check=False).stdout.strip()


def records(fleet: Fleet, hosts: list[Host]) -> dict[str, PullStats | None]:
    return {h.name: PullStats.from_json(fleet.run_in(h, f"cat {pull_stats_file(SERVICE)}").stdout) for h in hosts}


def listed(fleet: Fleet, host: Host) -> list[str]:
    return fleet.run_in(host, "docker images --digests --format '{{.Repository}}@{{.Digest}}'").stdout.split()


def big_layer(fleet: Fleet, tag: str) -> tuple[str, int]:
    """(digest, size) of a nightly's own layer, from the fleet registry's manifest."""
    _, _, body = sandbox_registry.registry_request(
        fleet.cfg, f"/v2/{sandbox_image.REPOSITORY}/manifests/{tag}", headers={"Accept": sandbox_registry.MANIFEST_TYPE}
    )
    layer = json.loads(body)["layers"][-1]
    return layer["digest"], layer["size"]


def test_prepare_downloads_each_layer_from_upstream_once_per_site(site):
    fleet, hosts, refs, inventory, log = site
    names = [h.name for h in hosts]
    # The cache host first, alone (here it is the canary too), then the other two at once.
    assert pull_order(str(inventory), names[::-1]) == [[names[0]], [names[2], names[1]]]
    before, hub_before = services.log_offset(fleet.cfg), hub_offset(fleet)
    run, failed = prepare(str(inventory), names, refs["nightly-1"], DEPLOY, log=log, timeout_s=600)
    assert failed == {}, run.output[-4000:]
    served = services.blob_bytes(fleet.cfg, since=before)
    _, size = big_layer(fleet, "nightly-1")
    # Everything upstream served went to the cache host (the cache), and the big layer once: not once per host
    # (3x here). The bound leaves room for the image's small layers and for a retried part of a layer: under load the
    # cache host's own pull may give up on a slow layer and ask again (seen once at 1.27x on a busy CI machine).
    assert set(served) == {hosts[0].ip}, served
    assert size <= served[hosts[0].ip] < 2 * size, (served, size)
    print(f"upstream served {served} for a {size}-byte layer")
    # The model likewise: the hub served its bytes once, to the cache host's mirror; every host checked it.
    commit = hub_commit(fleet)
    assert hub_bytes(fleet, hub_before) == {hosts[0].ip: model_size(fleet, commit)}
    assert all(checked(fleet, h) == f"{MODEL}@{commit}" for h in hosts)
    stats = records(fleet, hosts)
    for h in hosts:
        got = stats[h.name]
        assert got is not None and got.ref == refs["nightly-1"] and not got.fell_back, (h.name, got)
        assert got.cache == f"{hosts[0].ip}:{CACHE_PORT}"
        if h is hosts[0]:
            # The first host's pull is what the cache fetched from upstream: its record says upstream, not site.
            assert got.upstream_bytes is not None and got.upstream_bytes >= size and got.site_bytes == 0, got
        else:
            assert got.site_bytes is not None and got.site_bytes >= size and got.upstream_bytes == 0, (h.name, got)
        # The unit's reference is the upstream one; nothing on the host names the cache.
        assert refs["nightly-1"] in listed(fleet, h) and not any(f":{CACHE_PORT}/" in r for r in listed(fleet, h))
    # The records agree with the registry's own log: what the hosts say came from upstream is what it served.
    recorded = sum(stats[h.name].upstream_bytes or 0 for h in hosts)
    assert recorded <= served[hosts[0].ip] < 1.25 * recorded, (recorded, served)
    # Only the inventory's hosts, only its repositories by digest, only pulls: this machine (no host of the
    # inventory) is refused even the API's root, a host of it another repository of upstream or a tag.
    cache = f"http://{hosts[0].ip}:{CACHE_PORT}"
    for url, data in [(f"{cache}/v2/", None), (f"{cache}/v2/{sandbox_image.REPOSITORY}/blobs/uploads/", b"")]:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10)
        assert refused.value.code == 403, (url, refused.value.code)
    digest = refs["nightly-1"].rpartition("@")[2]
    asked = {
        path: fleet.run_in(
            hosts[1], f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 10 {cache}{path}", check=False
        ).stdout
        for path in [
            "/v2/",
            f"/v2/{sandbox_image.REPOSITORY}/manifests/{digest}",
            f"/v2/library/busybox/manifests/{digest}",
            f"/v2/{sandbox_image.REPOSITORY}/manifests/nightly-1",
        ]
    }
    assert list(asked.values()) == ["200", "200", "403", "403"], asked
    # A second prepare on the cache host: its setup and the trust in it change nothing; nothing is pulled.
    again = prepare(str(inventory), [names[0]], refs["nightly-1"], DEPLOY, log=log, timeout_s=600)[0]
    assert again.ok, again.output[-3000:]
    changed = changed_ops(again.output)
    assert not any("site cache" in op or "Pull" in op for op in changed), changed


def trusted(fleet: Fleet, host: Host) -> list[str]:
    """The host's Docker insecure-registries."""
    return json.loads(fleet.run_in(host, "cat /etc/docker/daemon.json").stdout).get("insecure-registries", [])


def test_cache_host_down_every_host_prepares_from_upstream_with_one_warning(site, pyinfra):
    fleet, hosts, refs, inventory, log = site
    others = hosts[1:]
    for h in others:  # their model gone too: it comes from the hub, each host saying why
        fleet.run_in(h, f"rm -rf {MODEL_DIR}")
    hub_before = hub_offset(fleet)
    # The cache host off the network (a converge of the cache host itself would start a stopped registry again).
    fleet.set_connected(hosts[0], False)
    try:
        run, failed = prepare(
            str(inventory), [h.name for h in others], refs["nightly-2"], DEPLOY, log=log, timeout_s=600
        )
    finally:
        fleet.set_connected(hosts[0], True)
    assert failed == {}, run.output[-4000:]
    cache = f"{hosts[0].ip}:{CACHE_PORT}"
    for h in others:
        warnings = [
            line
            for line in run.output.splitlines()
            if re.search(rf"{h.name}: warning: the site cache {re.escape(cache)} \({hosts[0].name}\)", line)
        ]
        assert len(warnings) == 1, (h.name, run.output[-4000:])
        got = records(fleet, hosts)[h.name]
        assert got is not None and got.ref == refs["nightly-2"] and got.fell_back and got.cache is None, got
        assert refs["nightly-2"] in listed(fleet, h)
        mirror = [
            line
            for line in run.output.splitlines()
            if f"{h.name}: warning: the site cache's model mirror http://{cache} ({hosts[0].name}) is not "
            "reachable" in line
        ]
        assert len(mirror) == 1, (h.name, run.output[-4000:])
        assert checked(fleet, h) == f"{MODEL}@{hub_commit(fleet)}"
    size = model_size(fleet, hub_commit(fleet))
    assert hub_bytes(fleet, hub_before) == {h.ip: size for h in others}
    # Told not to pull through it (site_cache_address "off"), a host no longer trusts it over plain HTTP.
    assert cache in trusted(fleet, others[0])
    off = run_deploy(
        pyinfra,
        inventory,
        str(DEPLOY),
        "--limit",
        others[0].name,
        "--data",
        "site_cache_address=off",
        "--data",
        "gpufleet_stage=prepare",
        "--data",
        f"gpufleet_image_ref={refs['nightly-2']}",
    )
    assert cache not in trusted(fleet, others[0]), off.stdout[-3000:]


def test_tampered_blob_on_the_cache_is_refused_and_pulled_from_upstream_naming_the_refusal(site):
    # Whoever answers at the cache's address (a tampered storage here) must not fail every prepare: docker refuses
    # what does not hash to the digest, and the host pulls it from upstream, saying so.
    fleet, hosts, refs, inventory, log = site
    victim = hosts[2]
    digest, _ = big_layer(fleet, "nightly-1")
    hexd = digest.removeprefix("sha256:")
    fleet.run_in(hosts[0], f"printf XXXXXXXX | dd of={STORAGE}/{hexd[:2]}/{hexd}/data bs=1 seek=4096 conv=notrunc")
    fleet.run_in(victim, f"docker rmi {refs['nightly-1']}")
    run, failed = prepare(str(inventory), [victim.name], refs["nightly-1"], DEPLOY, log=log, timeout_s=600)
    assert failed == {}, run.output[-4000:]
    [warning] = [line for line in run.output.splitlines() if f"{victim.name}: warning: the site cache" in line]
    assert "served content that does not match" in warning and "docker refused it; pulling from upstream" in warning
    got = records(fleet, [victim])[victim.name]
    assert got is not None and got.fell_back and got.warning and warning.endswith(got.warning), (got, warning)
    assert refs["nightly-1"] in listed(fleet, victim)
    assert not any(f":{CACHE_PORT}/" in r for r in listed(fleet, victim))


def test_the_cache_is_held_to_its_bound(site, pyinfra):
    fleet, hosts, refs, inventory, _log = site
    cache_host, ref = hosts[0], refs["nightly-1"]
    args = ("--limit", cache_host.name, "--data", "gpufleet_stage=prepare", "--data", f"gpufleet_image_ref={ref}")
    # A bound the disk cannot hold is refused before anything changes.
    refused = run_deploy(pyinfra, inventory, str(DEPLOY), *args, "--data", "site_cache_max_gb=100000", check=False)
    assert refused.returncode != 0 and re.search(
        rf"{cache_host.name}: .* GiB free at \S+ \(the site cache, holding 0\.\d GiB\), site_cache_max_gb asks for "
        r"100000 .*\(fix: free space there, or lower site_cache_max_gb\)",
        refused.stdout,
    ), refused.stdout[-3000:]
    # It holds nightly-1 (~113 MB), its big layer tampered with by the test before. Over a bound of 50 MB it is
    # emptied before the cache host's own pull, which fills it again from upstream: the layer is whole again.
    digest, _ = big_layer(fleet, "nightly-1")
    blob = f"{STORAGE}/{digest[7:9]}/{digest[7:]}/data"
    assert fleet.run_in(cache_host, f"sha256sum {blob}").stdout.split()[0] != digest[7:]
    fleet.run_in(cache_host, f"docker rmi {ref}")
    run_deploy(pyinfra, inventory, str(DEPLOY), *args, "--data", "site_cache_max_gb=0.05")
    assert fleet.run_in(cache_host, f"sha256sum {blob}").stdout.split()[0] == digest[7:]
    assert ref in listed(fleet, cache_host)


def test_a_model_file_tampered_with_in_the_mirror_is_refused_and_fetched_from_the_hub(site):
    """olah checks its blocks by CRC32s kept beside them: a tamperer who rewrites both has it serve the bytes.
    The hub's sha256 refuses them; the file comes from the hub itself, once; nothing bad is left to serve."""
    fleet, hosts, refs, inventory, log = site
    victim, commit = hosts[2], hub_commit(fleet)
    fleet.run_in(
        hosts[0],
        "python3 - <<'EOF'\n"
        "import glob, zlib\n"
        f"d = glob.glob('{MIRROR_STORAGE}/{MODEL}/resolve/{commit}/model.safetensors')[0]\n"
        "b = bytearray(open(d + '/blocks/block_00000000.bin', 'rb').read()); b[100:108] = b'TAMPERED'\n"
        "open(d + '/blocks/block_00000000.bin', 'wb').write(b)\n"
        "c = bytearray(open(d + '/chunks.crc', 'rb').read())\n"
        "c[0:4] = (zlib.crc32(bytes(b[:1 << 20])) & 0xFFFFFFFF).to_bytes(4, 'little')\n"
        "open(d + '/chunks.crc', 'wb').write(c)\nEOF",
    )
    fleet.run_in(victim, f"rm -rf {MODEL_DIR}")
    hub_before = hub_offset(fleet)
    run, failed = prepare(str(inventory), [victim.name], refs["nightly-1"], DEPLOY, log=log, timeout_s=600)
    assert failed == {}, run.output[-4000:]
    [warning] = [line for line in run.output.splitlines() if f"{victim.name}: warning:" in line and "model" in line]
    assert "served 1 file(s) whose hash is not the hub's (model.safetensors): refused; fetching from the hub" in warning
    good = next(
        f for f in standin_hub.listing(services.hub_root(fleet.cfg), MODEL, commit) if f.path == "model.safetensors"
    )
    assert fleet.run_in(victim, f"sha256sum {MODEL_DIR}/model.safetensors").stdout.split()[0] == good.sha256
    assert checked(fleet, victim) == f"{MODEL}@{commit}"
    assert hub_bytes(fleet, hub_before) == {victim.ip: good.size}  # that file again, from the hub itself


def test_a_moved_branch_changes_nothing_until_a_run_asks_and_its_prepare_downloads_it(site, pyinfra):
    fleet, hosts, refs, inventory, log = site
    host, first = hosts[1], hub_commit(fleet)
    args = ("--limit", host.name, "--data", f"gpufleet_image_ref={refs['nightly-2']}")
    run_deploy(pyinfra, inventory, str(DEPLOY), *args)  # converged: the ledger records the model's commit
    ledger = json.loads(fleet.run_in(host, f"cat /var/lib/gpufleet/{SERVICE}.json").stdout)
    assert ledger["committed"]["model"] == f"{MODEL}@{first}"
    # main moves on the hub: a converge keeps the recorded commit, and changes nothing.
    files = {
        f.path: services.hub_root(fleet.cfg) / MODEL / "commits" / first / f.path
        for f in standin_hub.listing(services.hub_root(fleet.cfg), MODEL, first)
    }
    moved = standin_hub.publish(
        services.hub_root(fleet.cfg), MODEL, {**files, "generation_config.json": b'{"temperature": 0.7}\n'}
    )
    again = run_deploy(pyinfra, inventory, str(DEPLOY), *args)
    assert changes(again.stdout) == 0, changed_ops(again.stdout)
    assert checked(fleet, host) == f"{MODEL}@{first}"
    # Asked for it (a rollout's prepare): downloaded and checked while the old version serves, nothing restarted.
    hub_before = hub_offset(fleet)
    run, failed = prepare(
        str(inventory), [host.name], refs["nightly-2"], DEPLOY, log=log, timeout_s=600, model_sha=moved
    )
    assert failed == {}, run.output[-4000:]
    assert checked(fleet, host) == f"{MODEL}@{moved}"
    assert sum(hub_bytes(fleet, hub_before).values()) == len(b'{"temperature": 0.7}\n')  # the changed file, once
    # The swap's converge: a new unit (it names the commit), a restart, nothing downloaded in the downtime.
    swap = run_deploy(pyinfra, inventory, str(DEPLOY), *args, "--data", f"gpufleet_model_sha={moved}")
    changed = changed_ops(swap.stdout)
    assert "Install the vLLM systemd unit" in changed and DOWNLOAD not in changed, changed
    ledger = json.loads(fleet.run_in(host, f"cat /var/lib/gpufleet/{SERVICE}.json").stdout)
    assert ledger["committed"]["model"] == f"{MODEL}@{moved}"
