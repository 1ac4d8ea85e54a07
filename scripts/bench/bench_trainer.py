"""End-to-end training throughput, side by side in one run: open_clip's own trainer (v3.3,
eager and ``--torchcompile``) and ours (train.py, from shards decoded by the real pipeline).

    python scripts/bench/bench_trainer.py --out $OUT \\
        --runs openclip:32768,openclip_compile:32768,ours:32768,ours_compile:32768,lit:65536

A run is ``kind[@gpus]:global_batch[:steps[:override;override...]]``; ``@N`` runs it on N GPUs of
this machine under torchrun (default 1), e.g. the scaling rows and open_clip beside ours on 2 GPUs:

    python scripts/bench/bench_trainer.py --shards '/tmp/photos256/{00000..00031}.tar' \
        --runs ours_compile:65536,ours_compile@2:65536,ours_compile@4:65536,openclip_compile@2:65536

``@Nn`` runs ours as N simulated nodes of one GPU each: N torchrun agents on this machine
(``--nnodes N``, c10d rendezvous on localhost), each given one GPU and an equal share of the
cores, NCCL's peer-to-peer and shared-memory transports off (``NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1``; ``NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4`` unless set), so every
collective takes the socket transport as between machines; beside the same run on N GPUs of
one node, it shows what the network costs the step:

    python scripts/bench/bench_trainer.py --shards '/tmp/photos256/{00000..00031}.tar' \\
        --runs ours_compile@2:65536,ours_compile@2n:65536,ours_compile@2:262144,ours_compile@2n:262144

Hydra overrides of ours (e.g.
``ours_compile:32768:4:data.decode=cpu``) or open_clip_train arguments of its runs as
``--flag=value`` (e.g. ``openclip_compile:32768:3:--model=ViT-B-16;--force-patch-dropout=0.5``).
A run's model is ``model.name=`` / ``--model=`` there (default ViT-B/32; LiT: ViT-B/16), and
its FLOPs per sample are counted with its patch dropout (``model.patch_dropout`` /
``--force-patch-dropout``: the kept patches only). The FLIP comparison (ViT-B/16, 32k):

    python scripts/bench/bench_trainer.py --runs 'openclip_compile:32768:3:--model=ViT-B-16,ours_compile:32768:3:model.name=ViT-B-16,openclip_compile:32768:3:--model=ViT-B-16;--force-patch-dropout=0.5,ours_compile:32768:3:model.name=ViT-B-16;model.patch_dropout=0.5'

Kinds:

* ``openclip`` / ``openclip_compile``: ``python -m open_clip_train.main --dataset-type
  webdataset --dataset-resampled --train-data SHARDS`` (the same shards as ours; or
  ``--openclip-data synthetic``: its synthetic data, no JPEG decoded) ``--model ViT-B-32 --precision amp_bf16 --batch-size MICRO --accum-freq G/MICRO``
  (its feature cache + re-forward; all inputs on the GPU), ``--torchcompile`` for the second;
* ``openclipmain`` / ``openclipmain_compile``: the same with open_clip's main branch, imported
  from ``--openclip-main DIR`` (a folder it was installed into: ``pip install --no-deps
  --target DIR open_clip_torch-*.whl``, the wheel built from its repository); its
  ``--torchcompile`` compiles the task's forward (``--torchcompile-strategy task``, its
  default: the ``step`` strategy refuses ``--accum-freq`` above 1, which a 65,536 batch needs);
* ``ours`` / ``ours_compile``: ``train.py experiment=vit_b32_laion`` on ``--shards`` (JPEG
  shards written by ``scripts/bench/bench_data.py``'s writer if absent), gradient cache with
  micro-batch MICRO, offload, bf16, Triton loss, the step pipeline; ``model.compile=true``;
* ``lit`` / ``lit_compile``: ``experiment=lit_b16_cc12m`` (ViT-B/16, image tower locked,
  images streamed through the locked tower).

Per run: the median over the steady steps (all but the first) of samples/s and the step
split (data wait, cache pass, rank 0's wait for the other ranks' cache pass, loss, replay,
optimizer), peak GPU memory
(``max_memory_allocated``), peak host RSS of the trainer process, and model FLOPs
utilisation: samples/s x FLOPs per sample / (``--peak-tflops`` x the run's GPUs), with a sample costing 4
forward passes of each trained tower under the gradient cache (no-grad pass, replay forward,
backward = 2 forwards) and 1 of a locked one; forward FLOPs counted by
``torch.utils.flop_counter`` on the real model. Writes ``trainer.json`` and ``trainer.md``
after each run (atomically). A SIGTERM, SIGINT or SIGHUP (an outer ``timeout``, a scheduler,
Ctrl-C) ends the run in flight with what it started; its finished steps and the runs before
it are written, and the script exits with 128 + the signal's number; later runs do not start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))

from infclip.records import read_records  # noqa: E402  (torch-free)

OPENCLIP_LINE = re.compile(r"Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+), ([\d.]+)/s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="openclip:32768,openclip_compile:32768,ours:32768,ours_compile:32768")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not counted)")
    p.add_argument("--micro", type=int, default=1024)
    p.add_argument("--workers", default="auto",
                   help="loader workers per rank: a number, or auto (ours: data.workers=auto; open_clip: "
                        "the same count, the cores this process may use / GPUs of the run, less one)")
    p.add_argument("--shards", default="/tmp/infclip_trainer_shards")
    p.add_argument("--images", type=int, default=16384, help="JPEGs written when --shards is empty")
    p.add_argument("--side", type=int, default=128, help="stored JPEG side")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense peak of the GPU")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--out", default=os.environ.get("OUT", ".bench"), help="trainer.json / trainer.md")
    p.add_argument("--logs", default="/tmp/bench_trainer_logs", help="one log per run")
    p.add_argument("--extra", default="", help="extra overrides for our runs (space-separated)")
    p.add_argument("--profile-step", type=int, default=0,
                   help="our runs: profile this step (logging.profile_step) and copy its summary to "
                        "OUT/profile_<kind>_<batch>.md (the profiler slows that step: leave it out of the "
                        "median with --steps one more than it)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval (s) in our trainer's process (GIL hand-over latency between "
                        "the training and decoding threads; Python's default is 0.005)")
    p.add_argument("--openclip-main", default=None, metavar="DIR",
                   help="folder holding open_clip's main branch (pip install --no-deps --target DIR "
                        "open_clip_torch-*.whl) for the openclipmain kinds")
    p.add_argument("--openclip-data", default="wds", choices=("wds", "synthetic"),
                   help="open_clip reads the same shards through its webdataset loader, or its synthetic data")
    return p.parse_args(argv)


def ensure_shards(a: argparse.Namespace) -> str:
    """Brace spec of the benchmark shards: ``--shards`` itself when it is one (e.g. the
    real-photo shards of data/write_photo_shards.py), else a folder written if empty."""
    if "{" in a.shards:
        return a.shards
    from bench_data import write_bench_shards

    root = Path(a.shards)
    if not (root / "sizes.json").exists():
        t0 = time.time()
        write_bench_shards(str(root), a.images, a.side, max(32, 2 * workers_for(a, 1)))
        print(f"wrote {a.images} {a.side}-px JPEGs to {root} in {time.time() - t0:.0f} s", flush=True)
    n = len(list(root.glob("*.tar")))
    return str(root / f"{{00000..{n - 1:05d}}}.tar")


# printed by the child at exit: its own peak GPU memory and peak host RSS (the trainer
# process; loader workers hold only their in-flight batches)
_PEAKS = ("import atexit, resource, sys, torch; atexit.register(lambda: print("
          "'PEAK_GPU_GB', torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0, "
          "'\\nPEAK_RSS_GB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, flush=True)); ")


def _peak(out: str, key: str) -> float:
    """The largest of the ranks' ``key`` lines (each rank prints its own peak at exit)."""
    found = re.findall(key + r" ([\d.]+)", out)
    return max(map(float, found)) if found else float("nan")


def openclip_args(overrides: list[str]) -> tuple[str, list[str]]:
    """(model name, extra arguments) from a run's ``--flag=value`` overrides (``--model`` picks
    the model; default ViT-B-32)."""
    model, extra = "ViT-B-32", []
    for o in overrides:
        flag, eq, value = o.partition("=")
        if not flag.startswith("--") or not eq:
            raise SystemExit(f"open_clip run override {o!r}: write open_clip_train arguments as --flag=value")
        if flag == "--model":
            model = value
        else:
            extra += [flag, value]
    return model, extra


def run_model(kind: str, overrides: list[str]) -> tuple[str, float]:
    """(open_clip model name, patch dropout) of a run, from its kind and overrides."""
    model, drop = ("ViT-B-16" if kind.startswith("lit") else "ViT-B-32"), 0.0
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("model.name", "--model"):
            model = value
        elif key in ("model.patch_dropout", "--force-patch-dropout"):
            drop = float(value)
    return model, drop


def split_gpus(kind: str) -> tuple[str, int]:
    """(kind, GPUs) of a run's ``kind[@N]`` or ``kind@Nn`` (N simulated nodes, :func:`sim_nodes`)."""
    name, at, n = kind.partition("@")
    n = n[:-1] if n.endswith("n") else n
    if at and (not n.isdigit() or int(n) < 1):
        raise SystemExit(f"run kind {kind!r}: write the GPU count as kind@N (one node) or kind@Nn "
                         "(N simulated nodes of one GPU each) with N >= 1")
    return name, int(n) if n else 1


def sim_nodes(kind: str) -> bool:
    """Whether ``kind@Nn`` asks for N simulated nodes (one GPU each, NCCL over sockets)."""
    return kind.partition("@")[2].endswith("n")


def workers_for(a, gpus: int) -> int:
    """Loader workers per rank for open_clip's runs (ours take ``data.workers=auto`` then)."""
    if str(a.workers) != "auto":
        return int(a.workers)
    return max(1, len(os.sched_getaffinity(0)) // gpus - 1)


def launcher(gpus: int, logs: Path, body: str) -> list[str]:
    """The command that runs the Python ``body`` (a script's text) on ``gpus`` local ranks:
    ``python -c`` for one, torchrun over a file holding it for more (NCCL multicast off)."""
    if gpus == 1:
        return [sys.executable, "-c", body]
    script = logs / f"launch_{hashlib.sha1(body.encode()).hexdigest()[:10]}.py"
    script.write_text(body)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", str(script)]


SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
SOCKET_DEFAULTS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}  # train.sbatch's, where unset


@dataclass
class Node:
    """One simulated node: its torchrun command, its environment additions, its cores."""

    cmd: list[str]
    env: dict[str, str]
    cpus: list[int]


def node_launchers(nodes: int, logs: Path, body: str) -> list[Node]:
    """``nodes`` torchrun agents that together run the Python ``body`` as one job of ``nodes``
    ranks: c10d rendezvous on a free localhost port, one GPU each (the i-th of
    ``CUDA_VISIBLE_DEVICES``, or GPU i), contiguous equal shares of this process's cores, NCCL's
    peer-to-peer and shared-memory transports off (every collective over sockets)."""
    script = logs / f"launch_{hashlib.sha1(body.encode()).hexdigest()[:10]}.py"
    script.write_text(body)
    with socket.socket() as sock:  # a free port for the rendezvous (released before torchrun binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and len(visible) < nodes:
        raise SystemExit(f"{nodes} simulated nodes need {nodes} GPUs; CUDA_VISIBLE_DEVICES names {len(visible)}")
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // nodes)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=bench{port}", str(script)]
    out = []
    for i in range(nodes):
        env = {**SOCKET_ENV, **{k: v for k, v in SOCKET_DEFAULTS.items() if k not in os.environ},
               "CUDA_VISIBLE_DEVICES": visible[i] if visible else str(i)}
        out.append(Node(cmd, env, cores[i * share:(i + 1) * share] or cores))
    return out


def run_openclip(a, global_batch: int, steps: int, compile_: bool, spec: str, overrides: list[str],
                 gpus: int = 1, main_branch: bool = False) -> dict:
    accum = global_batch // (a.micro * gpus)
    model, extra = openclip_args(overrides)
    tag = _tag([o.lstrip("-") for o in overrides])
    name = "openclipmain" if main_branch else "openclip"
    logs = Path(a.logs) / f"{name}_logs_{global_batch}_{int(compile_)}{tag}"
    subprocess.run(["rm", "-rf", str(logs)])
    # On our shards through its own webdataset loader (resampled: any shard count works),
    # or its synthetic dataset (no JPEG decoded at all) when --openclip-data synthetic.
    data = (["--dataset-type", "synthetic"] if a.openclip_data == "synthetic" else
            ["--dataset-type", "webdataset", "--dataset-resampled", "--train-data", spec])
    args = [*data, "--model", model, *extra,
            "--precision", "amp_bf16", "--batch-size", str(a.micro), "--accum-freq", str(accum),
            "--workers", str(workers_for(a, gpus)), "--train-num-samples", str(global_batch * steps), "--epochs", "1",
            "--log-every-n-steps", "1", "--save-frequency", "0", "--lr", "1e-3",
            "--warmup", "1", "--logs", str(logs), "--name", "bench"]
    if compile_:
        args.append("--torchcompile")
    if gpus > 1:  # its recommended multi-GPU loss: each rank's rows against the gathered columns
        args += ["--local-loss", "--gather-with-grad"]
    # the arguments live in the launched script: torchrun's parser would read its own options'
    # abbreviations (--logs for --logs-specs) among a script's arguments
    wrapper = (_PEAKS + "import open_clip; print('OPENCLIP_VERSION', open_clip.__version__, flush=True); "
               f"from open_clip_train.main import main; main({args!r})")
    cmd = launcher(gpus, Path(a.logs), wrapper)
    out = _run(cmd, a.timeout, Path(a.logs) / f"{name}_{global_batch}_{int(compile_)}_{gpus}gpu{tag}.log",
               path_first=a.openclip_main if main_branch else None)
    version = re.findall(r"OPENCLIP_VERSION (\S+)", out)
    rows = [(float(d), float(b), float(s)) for d, b, s in OPENCLIP_LINE.findall(out)]
    steady = rows[1:] or rows
    return {"samples_per_s": _median(r[2] for r in steady), "step_s": _median(r[1] for r in steady),
            "data_wait_s": _median(r[0] for r in steady), "gpu_gb": _peak(out, "PEAK_GPU_GB"),
            "host_rss_gb": _peak(out, "PEAK_RSS_GB"), "steps_seen": len(rows),
            "step_samples_per_s": [r[2] for r in rows],  # every step's, the first (compile) included
            "open_clip": version[-1] if version else "not imported"}


def run_ours(a, kind: str, global_batch: int, steps: int, spec: str, overrides: list[str], gpus: int = 1,
             nodes: bool = False) -> dict:
    """Ours on ``gpus`` GPUs: one node, or (``nodes``) as many simulated nodes of one GPU each."""
    lit = kind.startswith("lit")
    where = f"{gpus}node" if nodes else f"{gpus}gpu"
    # What sets the run apart (its micro-batch, --extra and its overrides) names its run_dir by a
    # hash, keeping runs of other models or micro-batches apart when benchmarks share a machine
    # (the readable tag's '=' would not pass as a Hydra value), and its log by the tag.
    named = [f"batch.micro_size={a.micro}", *a.extra.split(), *overrides]
    run_dir = Path("/tmp") / f"bench_{kind}_{where}_{global_batch}_{_digest(named)}"
    subprocess.run(["rm", "-rf", str(run_dir)])
    # python -c gets train.py's path as argv[1], a torchrun script the overrides alone: either
    # way train.py sees itself as argv[0]
    train = (f"sys.argv = [{str(ROOT / 'train.py')!r}] + sys.argv[{2 if gpus == 1 and not nodes else 1}:]; "
             f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')")
    switch = "" if a.switch_interval is None else f"sys.setswitchinterval({a.switch_interval}); "
    body = _PEAKS + switch + "import runpy; " + train
    launch = [] if nodes else launcher(gpus, Path(a.logs), body)
    args = [*([str(ROOT / "train.py")] if gpus == 1 and not nodes else []), f"experiment={'lit_b16_cc12m' if lit else 'vit_b32_laion'}",
           f"data.shards='{spec}'", "data.resampled=true", f"data.workers={a.workers}", "data.loader_batch=256",
           f"batch.global_size={global_batch}", f"batch.micro_size={a.micro}", "memory.offload=true",
           f"steps={steps}", "schedule.warmup_fraction=0", "logging.every_n_steps=1", "logging.progress=false",
           "logging.wandb_mode=disabled", "checkpoint.every_n_steps=0", "eval.tasks=[]", f"run_dir={run_dir}",
           f"model.compile={str(kind.endswith('compile')).lower()}", *a.extra.split(), *overrides]
    if a.profile_step:
        args.append(f"logging.profile_step={a.profile_step}")
    log = Path(a.logs) / f"{kind}_{where}_{global_batch}{_tag(named)}.log"
    if nodes:
        out = _run_nodes([Node(n.cmd + args, n.env, n.cpus) for n in node_launchers(gpus, Path(a.logs), body)],
                         a.timeout, log)
    else:
        out = _run([*launch, *args], a.timeout, log)
    mfile = run_dir / "metrics.jsonl"
    recs = read_records(mfile)  # (a line cut by a killed run is left out)
    steps_ = step_records(recs, a.profile_step)
    summary = run_dir / "profile" / f"step_{a.profile_step}_rank_0.md"
    if a.profile_step and summary.exists():
        shutil.copyfile(summary, Path(a.out) / _out_name(f"profile_{kind}_{global_batch}{_tag(overrides)}.md"))
    for trace in sorted((run_dir / "decode_trace").glob("step_*_rank_0.json")):  # logging.decode_trace_step
        shutil.copyfile(trace, Path(a.out) / _out_name(f"decode_trace_{kind}_{global_batch}{_tag(overrides)}_{trace.stem}.json"))
    steady = steps_[1:] or steps_  # the first step (compile, warm-up) is not counted
    pick = lambda k: _median(r.get(k, float("nan")) for r in steady)  # noqa: E731
    res = {"samples_per_s": pick("samples_per_s"), "step_s": pick("step_time"),
           "data_wait_s": pick("time_data_wait"), "cache_s": pick("time_cache_pass"),
           "rank_wait_s": pick("time_rank_wait"),  # rank 0 waiting for the others' cache pass (NaN on one rank)
           "loss_s": pick("time_loss"),
           "replay_s": pick("time_replay"), "optim_s": pick("time_optim"),
           "loader_sps": pick("loader_samples_per_s"), "decode_ips": pick("decode_imgs_per_s"),
           "decode_busy_pct": pick("decode_busy_pct"),  # the decoder's share of the step (data.decode=device)
           "decode_busy_first_pct": pick("decode_busy_first_pct"),  # ... and of the cache pass
           "cpu_decoded_sps": pick("loader_cpu_decoded_per_s"),  # data.cpu_decode_share (NaN without)
           "host_kb_per_sample": pick("host_image_bytes_per_sample") / 1000,
           "decoder": _decoder_line(out), **_gpu_peak(out, steps_),
           "host_rss_gb": _peak(out, "PEAK_RSS_GB"), "steps_seen": len(steps_),
           # every step's (the first, compile and warm-up, included; a profiled step left out)
           "step_samples_per_s": [r["samples_per_s"] for r in steps_]} if steps_ else {
               "samples_per_s": float("nan"), "steps_seen": 0}
    subprocess.run(["rm", "-rf", str(run_dir / "checkpoints")])
    return res


PEAK_FROM_EXIT = "exit lines, largest rank"
PEAK_FROM_STEPS = "rank 0's step records (ended before its exit lines)"


def _gpu_peak(out: str, steps: list[dict]) -> dict:
    """The run's peak GPU memory: the largest rank's exit line, or, where the run was ended (its
    timeout) before the ranks printed them, the largest ``gpu_mem_gb`` (the same
    ``max_memory_allocated``) of rank 0's step records, said in ``gpu_gb_source``."""
    exit_peak = _peak(out, "PEAK_GPU_GB")
    logged = [r["gpu_mem_gb"] for r in steps if isinstance(r.get("gpu_mem_gb"), (int, float))]
    if exit_peak == exit_peak or not logged:
        return {"gpu_gb": exit_peak, "gpu_gb_source": PEAK_FROM_EXIT}
    return {"gpu_gb": max(logged), "gpu_gb_source": PEAK_FROM_STEPS}


def step_records(recs: list[dict], profile_step: int = 0) -> list[dict]:
    """A run's per-step metrics records, the profiled step (slowed by the profiler) left out."""
    return [r for r in recs if "samples_per_s" in r and not (profile_step and r.get("step") == profile_step)]


def _decoder_line(out: str) -> str:
    """The startup line's decode choice, e.g. 'device (auto: ...; decoder hardware (...))'."""
    found = re.findall(r"^data: decode=(.*)$", out, re.M)
    return found[-1][:160] if found else "?"


def fwd_gflops(model_name: str, patch_dropout: float = 0.0) -> tuple[float, float]:
    """Forward GFLOPs per sample of (image tower, text tower), counted on the real model in
    train mode (with ``patch_dropout``: the patches it keeps)."""
    import open_clip
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # train mode with grad: in eval/no-grad nn.MultiheadAttention takes its fused fast path,
    # which the flop counter does not see (ViT-B/32 would count 5.9 GFLOP instead of 8.7)
    model = open_clip.create_model(model_name, force_patch_dropout=patch_dropout).cuda().train()
    img = torch.randn(8, 3, 224, 224, device="cuda")
    txt = torch.randint(0, 1000, (8, 77), device="cuda")
    res = []
    for fn, x in ((model.encode_image, img), (model.encode_text, txt)):
        with FlopCounterMode(display=False) as fc:
            fn(x)
        res.append(fc.get_total_flops() / 8 / 1e9)
    return res[0], res[1]


def _out_name(name: str) -> str:
    """A file name for OUT in letters, digits, '.', '_' and '-' only (the device tool leaves
    names with other characters, '=' among them, behind)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def _tag(overrides: list[str]) -> str:
    """A log name's part for a run's overrides: readable, cut to 60 characters, and a short
    hash of all of them (runs that differ only past the cut get logs of their own)."""
    if not overrides:
        return ""
    return "_" + re.sub(r"[^\w.=-]", "-", "_".join(overrides))[:60] + "_" + _digest(overrides)


def _digest(overrides: list[str]) -> str:
    """8 hex digits naming a run's overrides (its log's and run_dir's suffix)."""
    return hashlib.sha1("_".join(overrides).encode()).hexdigest()[:8]


class Stop:
    """The signal that asked the script to stop (0: none) and the runs in flight, whose process
    trees the handler kills so that their waits return at once."""
    signum = 0
    pids: set[int] = set()

    @classmethod
    def handle(cls, signum, _frame) -> None:
        """Kill the runs in flight; the first signal is remembered, a second exits at once."""
        first = cls.signum
        cls.signum = first or signum
        for pid in list(cls.pids):
            kill_tree(pid)
        if first:
            os._exit(128 + first)

    @classmethod
    def started(cls, pid: int) -> None:
        """Track ``pid``; killed at once if the signal came while it was starting."""
        cls.pids.add(pid)
        if cls.signum:
            kill_tree(pid)

    @classmethod
    def ending(cls) -> str:
        return f"\nSTOPPED ({signal.Signals(cls.signum).name})\n" if cls.signum else ""


def _run(cmd: list[str], timeout: float, log: Path, path_first: str | None = None) -> str:
    """The command's output (stdout and stderr, as written), streamed into ``log`` while it
    runs (a caller cut off meanwhile keeps what ran); a run past ``timeout`` is killed and
    its output ends with TIMEOUT, one ended by a signal to this script with STOPPED (SIGTERM).
    ``path_first`` goes first on the child's PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if path_first:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, env.get("PYTHONPATH")) if p)
    print(("" if not path_first else f"PYTHONPATH={env['PYTHONPATH']} ") + "$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
        Stop.started(proc.pid)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            f.write("\nTIMEOUT\n")
        finally:
            Stop.pids.discard(proc.pid)
        f.write(Stop.ending())
    out = log.read_text()
    print(f"  ({time.time() - t0:.0f} s) " + out.strip().splitlines()[-1][:300] if out.strip() else "", flush=True)
    return out


def _run_nodes(nodes: list[Node], timeout: float, log: Path) -> str:
    """:func:`_run` for simulated nodes: each node's command under its environment additions and
    cores, its output streamed into ``log`` with ``.nodeI`` before the suffix; all are killed
    (with what they started) once ``timeout`` has passed, or as soon as one node fails (the
    others would wait in the rendezvous or a collective for minutes). Returns the nodes'
    outputs, node 0's first, ending with TIMEOUT or ``NODE i FAILED (exit status s)`` where
    they were killed."""
    procs, files = [], []
    for i, node in enumerate(nodes):
        env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled", **node.env)
        # as a shell would run it: the nodes side by side, each on its cores
        print(shlex.join([*(f"{k}={v}" for k, v in node.env.items()), "taskset", "-c", _cpu_list(node.cpus),
                          *node.cmd]) + " &", flush=True)
        f = open(log.with_suffix(f".node{i}{log.suffix}"), "w")
        files.append(f)
        procs.append(subprocess.Popen(node.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                      start_new_session=True,
                                      preexec_fn=lambda cpus=node.cpus: os.sched_setaffinity(0, cpus)))
        Stop.started(procs[-1].pid)
    t0, ending = time.time(), ""
    while None in (codes := [p.poll() for p in procs]):  # every node polled each time round
        Stop.pids.difference_update(p.pid for p, c in zip(procs, codes) if c is not None)
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if Stop.signum:
            ending = Stop.ending()
        elif failed:
            ending = f"\nNODE {failed[0][0]} FAILED (exit status {failed[0][1]})\n"
        elif time.time() - t0 > timeout:
            ending = "\nTIMEOUT\n"
        if ending:
            for proc in procs:
                kill_tree(proc.pid)
            for proc in procs:
                proc.wait()
            break
        time.sleep(0.2)
    ending = ending or Stop.ending()
    Stop.pids.difference_update(p.pid for p in procs)
    for f in files:
        f.close()
    out = "\n".join(Path(f.name).read_text() for f in files) + ending
    log.write_text(out)
    print(f"  ({time.time() - t0:.0f} s) " + out.strip().splitlines()[-1][:300] if out.strip() else "", flush=True)
    return out


def _cpu_list(cpus: list[int]) -> str:
    """``0-15`` for a contiguous set, else the comma list."""
    if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first-found order."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started, also those in sessions of their own
    (torchrun's ranks, which would otherwise outlive it and hold the GPUs)."""
    for p in [*_descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:  # gone, or its number reused by a process not ours
            pass


def _median(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def openclip_wds_problem() -> str | None:
    """Why open_clip_train's webdataset loader cannot read shards with the installed
    webdataset, or None. webdataset after 0.2.86 yields an empty end-of-shard dict from
    ``tar_file_expander``, which open_clip_train 3.3's ``group_by_keys_nothrow`` indexes
    (``KeyError: 'fname'`` in its first loader batch)."""
    import inspect

    try:
        import webdataset
        from webdataset.tariterators import tar_file_expander
    except ImportError:
        return "open_clip's webdataset runs need webdataset: pip install webdataset==0.2.86"

    eof = inspect.signature(tar_file_expander).parameters.get("eof_value")
    if eof is None or eof.default is None:
        return None
    return (f"open_clip_train cannot read webdataset shards with webdataset {webdataset.__version__}: its "
            "tar_file_expander yields an empty end-of-shard sample that open_clip_train's group_by_keys_nothrow "
            "fails on (KeyError: 'fname'). Install webdataset==0.2.86 for the open_clip runs (infclip "
            "supports it), or pass --openclip-data synthetic.")


def openclip_main_problem(a: argparse.Namespace) -> str | None:
    """Why the openclipmain runs asked for cannot run, or None: they need ``--openclip-main``
    naming a folder that holds open_clip and open_clip_train."""
    if not any(r.startswith("openclipmain") for r in a.runs.split(",")):
        return None
    d = Path(a.openclip_main) if a.openclip_main else None
    if d is not None and (d / "open_clip").is_dir() and (d / "open_clip_train").is_dir():
        return None
    return (f"the openclipmain runs import open_clip's main branch from --openclip-main, "
            f"{'which is not given' if d is None else f'but {d} holds no open_clip and open_clip_train packages'}. "
            "Build its wheel from the repository (git archive HEAD src pyproject.toml README.md LICENSE, "
            "then pip wheel --no-deps .), install it apart with pip install --no-deps --target DIR "
            "open_clip_torch-*.whl, and pass --openclip-main DIR.")


def parse_run(run: str, default_steps: int) -> tuple[str, int, int, list[str]]:
    """(kind, global batch, steps, overrides) of one ``--runs`` entry
    ``kind:batch[:steps[:override;override...]]``; an override may hold colons
    (``data.decoder_options='nvjpeg_hw_decoder:force_batch_single=1'``)."""
    kind, g, *rest = run.split(":", 3)
    steps = int(rest[0]) if rest and rest[0] else default_steps
    return kind, int(g), steps, rest[1].split(";") if len(rest) > 1 else []


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.openclip_data == "wds" and any(r.startswith("openclip") for r in a.runs.split(",")):
        problem = openclip_wds_problem()
        if problem:
            print(problem, file=sys.stderr)
            raise SystemExit(2)
    problem = openclip_main_problem(a)
    if problem:
        print(problem, file=sys.stderr)
        raise SystemExit(2)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.logs).mkdir(parents=True, exist_ok=True)
    spec = ensure_shards(a)
    Stop.signum = 0
    # (a signal ignored here stays ignored: nohup's SIGHUP, a background job's SIGINT)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for sig, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, Stop.handle)
    try:
        run_all(a, spec)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run_all(a: argparse.Namespace, spec: str) -> None:
    """Each ``--runs`` entry in turn, the tables rewritten after each; stops (exit 128 + signal)
    after the run in flight when a signal came."""
    flops = {}
    results = []
    runs = a.runs.split(",")
    for run in runs:
        if Stop.signum:
            break
        kind, g, steps, overrides = parse_run(run, a.steps)
        nodes = sim_nodes(kind)
        kind, gpus = split_gpus(kind)
        if nodes and kind.startswith("openclip"):
            raise SystemExit(f"run {run!r}: simulated nodes (@Nn) run ours only; give open_clip kind@N")
        if kind.startswith("openclip"):
            res = run_openclip(a, g, steps, kind.endswith("compile"), spec, overrides, gpus,
                               main_branch=kind.startswith("openclipmain"))
        else:
            res = run_ours(a, kind, g, steps, spec, overrides, gpus, nodes=nodes)
        if Stop.signum:
            res["stopped"] = signal.Signals(Stop.signum).name
        model = run_model(kind, overrides)
        key = f"{model[0]} patch_dropout={model[1]}"
        if key not in flops and not Stop.signum:  # stopping: no model built for a FLOP count (MFU "—")
            flops[key] = fwd_gflops(*model)
        res["mfu_pct"] = (mfu_pct(res["samples_per_s"], *flops[key], lit=kind.startswith("lit"),
                                  peak_tflops=a.peak_tflops, gpus=gpus) if key in flops else float("nan"))
        res.update(kind=kind + "".join(f" {o}" for o in overrides), gpus=gpus, global_batch=g, steps=steps,
                   nodes=gpus if nodes else 1)
        results.append(res)
        print(json.dumps(res), flush=True)
        _write_atomic(Path(a.out) / "trainer.json", json.dumps({"flops_gflop": flops, "runs": results}, indent=1))
        _write_atomic(Path(a.out) / "trainer.md", _table(results))
    print(_table(results))
    if Stop.signum:
        print(f"stopped by {signal.Signals(Stop.signum).name} after {len(results)} of {len(runs)} run(s) started "
              f"(the last one's finished steps count); {Path(a.out) / 'trainer.md'} holds them.", file=sys.stderr)
        raise SystemExit(128 + Stop.signum)


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds the old text or the new, never a part: written beside it, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mfu_pct(samples_per_s: float, image_gflop: float, text_gflop: float, *, lit: bool,
            peak_tflops: float, gpus: int) -> float:
    """Model FLOPs utilisation in % of the run's GPUs together: a trained tower costs 4
    forwards per sample under the gradient cache, a locked one 1; ``samples_per_s`` is the whole
    run's rate, so the peak is ``peak_tflops`` times ``gpus``."""
    per_sample = (image_gflop * (1 if lit else 4) + text_gflop * 4) * 1e9
    return 100 * samples_per_s * per_sample / (peak_tflops * 1e12 * gpus)


def _table(results: list[dict]) -> str:
    keys = [("samples_per_s", "samples/s", "{:,.0f}"), ("mfu_pct", "MFU %", "{:.1f}"), ("step_s", "step s", "{:.2f}"),
            ("data_wait_s", "data wait s", "{:.2f}"), ("cache_s", "cache s", "{:.2f}"),
            ("rank_wait_s", "rank wait s", "{:.2f}"), ("loss_s", "loss s", "{:.3f}"),
            ("replay_s", "replay s", "{:.2f}"), ("optim_s", "optim s", "{:.3f}"), ("loader_sps", "loader samples/s", "{:,.0f}"),
            ("decode_ips", "GPU decode images/s", "{:,.0f}"), ("decode_busy_pct", "decoder busy %", "{:.0f}"),
            ("decode_busy_first_pct", "decoder busy % of cache pass", "{:.0f}"),
            ("cpu_decoded_sps", "worker-decoded images/s", "{:,.0f}"), ("host_kb_per_sample", "host image kB/sample", "{:.1f}"),
            ("gpu_gb", "peak GPU GB", "{:.1f}"), ("host_rss_gb", "peak host RSS GB", "{:.1f}")]
    lines = ["| run | GPUs | global batch | " + " | ".join(k[1] for k in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for r in results:
        cells = [fmt.format(r[k]) if isinstance(r.get(k), (int, float)) and r.get(k) == r.get(k) else "—"
                 for k, _, fmt in keys]
        steady = (r.get("step_samples_per_s") or [])[1:]
        if len(steady) > 1 and cells[0] != "—":  # the median's steps, as the docs quote them
            cells[0] += " (" + " / ".join("{:,.0f}".format(x) for x in steady) + ")"
        kind = r["kind"] + (f" ({r['open_clip']})" if r.get("open_clip") else "")
        if r.get("stopped"):
            kind += f" (stopped by {r['stopped']} after {r.get('steps_seen', 0)} step(s))"
        gpus = f"{r.get('gpus', 1)}" + (f" ({r['nodes']} nodes, sockets)" if r.get("nodes", 1) > 1 else "")
        if r.get("gpu_gb_source") == PEAK_FROM_STEPS:
            cells[[k for k, _, _ in keys].index("gpu_gb")] += " *"
        lines.append(f"| {kind} | {gpus} | {r['global_batch']:,} | " + " | ".join(cells) + " |")
    if any(r.get("gpu_gb_source") == PEAK_FROM_STEPS for r in results):
        lines += ["", "\\* rank 0's peak from its step records: the run was ended before its ranks printed theirs."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
