"""Example fleet: multi-GPU boxes in a homelab / small lab.

Run the main job:   pyinfra inventories/lab.py deploys/qwen35.py
See what it runs:   gpufleet render inventories/lab.py --host gpu-box-1
Check it first:     gpufleet lint inventories/lab.py   (clean but for the two findings accepted below, on purpose)

Fleet-wide settings live in group_data/all.py; per-host settings below win over them. Every setting, its
default and its meaning: README.md ("Settings") and src/gpufleet/defaults.py.
"""

# Names starting with "_" are no host groups: pyinfra skips them. A host's setting replaces the group's value as a
# whole (a host's vllm_args is not merged into the group's vllm_args), so every box below starts from these.

# The fixes `gpufleet lint` prints for the profile's invocation (the write-up's, kept flag for flag in the profile).
_VLLM_ARGS = {
    # On a restart (every deploy that changes the unit, every rollout) finish the answers being streamed for up to
    # 60 s instead of aborting them.
    "shutdown-timeout": 60,
    # Ignored in align mode (vLLM uses the attention block size), and explicit sizes have crashed hybrids.
    "mamba-block-size": None,
    # Qwen 3.5 is supported by vLLM itself: no need to run the model repo's Python code.
    "trust-remote-code": None,
}
_VLLM_ENV = {
    "VLLM_USE_FLASHINFER_MOE_FP16": None,  # deprecated; newer vLLM logs it as unknown
    # The profile's allocator settings under the name vLLM's torch reads (PYTORCH_ALLOC_CONF alone is ignored by
    # some torch versions).
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
    # Triton's and FlashInfer's JIT caches into the vLLM cache mount: kept across restarts, carried by a rollout.
    "TRITON_CACHE_DIR": "/root/.cache/vllm/triton",
    "FLASHINFER_WORKSPACE_BASE": "/root/.cache/vllm/flashinfer",
}
# Findings this lab accepts on purpose: `gpufleet lint` lists them as accepted and does not count them.
_ACCEPTED = [
    # The boxes sit on the lab's private LAN, whose agents connect without a key. On any shared network set
    # vllm_api_key instead (it is kept in a root-only file on the host) and drop this line.
    "open-without-api-key",
    # The prefix-match unit must divide the block size each server resolves at start-up, which only a running
    # server knows: after the first deploy `gpufleet verify inventories/lab.py --probe` prints the unit for each
    # box; set vllm_args prefix-match-unit to it and drop this line.
    "hybrid-align-chunk-alignment",
]


def _gpu_access(gpus: list[int]) -> dict:
    """Only these GPUs in the container, kept across a `systemctl daemon-reload`: no --privileged, the GPUs' device
    nodes listed. /dev/nvidia<N> is the GPU's minor number, its index on most hosts: check `nvidia-smi -q | grep
    Minor` on a new box."""
    nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", *(f"/dev/nvidia{g}" for g in gpus)]
    return {"vllm_gpus": gpus, "vllm_docker_options": {"privileged": None, "device": nodes}}


def _box(address: str, gpus: list[int], vllm_args: dict | None = None) -> dict:
    """A box's host data: its address, its GPUs, and the fleet's flags with its own over them."""
    return {
        "ssh_hostname": address,
        **_gpu_access(gpus),
        "vllm_args": {**_VLLM_ARGS, **(vllm_args or {})},
        "vllm_env": _VLLM_ENV,
        "gpufleet_accept": _ACCEPTED,
    }


gpu_boxes = [
    # The write-up's box: 3 GPUs, pipeline parallel 3, port 5000 (the profile's defaults). max-num-seqs 3: one
    # sequence per pipeline stage, so no stage sits idle (the profile's 2 leaves one idle).
    ("gpu-box-1", _box("192.168.1.50", [0, 1, 2], {"max-num-seqs": 3})),
    # A 2-GPU box: pipeline parallel must match the GPU count.
    ("gpu-box-2", _box("192.168.1.51", [0, 1], {"pipeline-parallel-size": 2})),
    # An 8-GPU box serving on 4 of them, leaving the rest for other work (which is why --privileged, exposing all
    # 8, must go). Tensor x pipeline = 2 x 2: pipeline parallel 4 or more with Qwen 3.5 has upstream failures
    # (`gpufleet lint` says so).
    ("gpu-box-3", _box("192.168.1.52", [4, 5, 6, 7], {"tensor-parallel-size": 2, "pipeline-parallel-size": 2})),
]

# One endpoint for every agent: vllm-router on a small CPU box in front of the boxes above (deploys/router.py,
# docs/router.md). Uncomment to use it; clients then talk to http://192.168.1.40:8000/v1. `gpufleet lint` checks
# its settings too.
# routers = [
#     ("router-1", {"ssh_hostname": "192.168.1.40", "router_policy": "cache_aware"}),
# ]
