"""The training loop: one step is fetch batch -> engine (cache pass, loss across ranks,
replay pass) -> optimizer -> log / eval / checkpoint.

Objects are built from the config in ``infclip.train.build``; the loop itself parses no config.
"""

from __future__ import annotations

import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from infclip import process_group
from infclip.config import check_run_length, infer_data_kind, validate
from infclip.data.decode_trace import format_summary, write_trace
from infclip.model import clamp_logit_scale
from infclip.train import checkpoint as ckpt
from infclip.train.build import Parts, apply_epochs, build, build_checkpointer
from infclip.train.agreement import check_same_config
from infclip.train.distributed import DistInfo, init_distributed, on_rank0, set_collective_timeout
from infclip.train.engine import unwrap as _unwrap
from infclip.train import slurm
from infclip.train.evaluation import eval_due, evaluate
from infclip.train.guard import NonFiniteError
from infclip.train.heartbeat import REPLAY_WEIGHT, StepHeartbeat
from infclip.train.resume import (last_finite_checkpoint, load_checkpoint, maybe_resume, refuse_other_data,
                                  refuse_other_world_early, resume_command)
from infclip.train.profiling import mark_phase_end, profiled_step
from infclip.train.rundir import derive_run_dir, record_start, run_dir_lock
from infclip.train.signals import signals_handled
from infclip.train.textlog import TextLog, text_log
from infclip.train.sm_partition import decode_bound_hint, running_on
from infclip.train.logger import _BOOKKEEPING, gpu_memory_gb, run_info
from infclip.train.pipeline import (
    LoaderStalled, StallWatch, StepPipeline, StoppedWaiting, TensorFeed, build_step_pipeline, duplicate_warning,
)


@dataclass
class State:
    step: int = 0
    samples: int = 0
    nonfinite_run: int = 0  # consecutive non-finite steps
    nonfinite_total: int = 0
    stop_requested: bool = False  # set only from the value all ranks agreed on (_agree_on_stop)
    stop_signal: int = 0  # the agreed stop signal (SIGUSR1: Slurm's warning -> requeue)
    signal_received: int = 0  # set by the handler on this rank; acted on after the next step
    interrupts: int = 0  # SIGINTs received (the second one exits at once: infclip.train.signals)
    saved_step: int = -1  # step of the newest checkpoint this process wrote or resumed from
    data_state: Optional[dict] = None  # loader position after the last *trained* step (not a prefetched one)
    step_rng: Optional[dict] = None  # RNG state at the start of the current step (single rank: to abandon it)
    decode_hinted: bool = False  # the decode-bound note was written (once a run)
    finishing: str = ""  # after the steps: what is left ("the final eval"), for a stop signal's line


def train(cfg: Any, overrides: Optional[list[str]] = None) -> dict:
    """Runs training as configured; returns the final metrics (on every rank)."""
    slurm.export_submitit_env()  # hydra-submitit tasks: RANK/WORLD_SIZE/MASTER_* from Slurm
    info = init_distributed(cfg.device, cfg.dist.timeout_s, cfg.dist.join_timeout_s)
    try:
        check_same_config(cfg, info, cfg.dist.join_timeout_s)  # the first collective, under the join timeout
        set_collective_timeout(cfg.dist.timeout_s)
        with text_log(info.is_main) as log:  # <run_dir>/out.log from the accepted start on
            inferred = infer_data_kind(cfg, overrides or [])  # data.shards without data.kind=wds
            validate(cfg, info.world_size)  # before any model or GPU work
            if inferred and info.is_main:
                print(inferred, flush=True)
            check_run_length(cfg, overrides or [])
            apply_epochs(cfg, info)  # epochs=N: steps from the dataset size
            run_dir = derive_run_dir(cfg)
            refuse_other_data(cfg, run_dir)  # a run folder of a run on other data: not resumed
            with run_dir_lock(run_dir, info):  # one training per run_dir (rank 0 holds the lock)
                return _start(cfg, info, run_dir, overrides or [], log)
    finally:
        process_group.leave()  # the group destroyed and its native threads joined now


def _start(cfg: Any, info: DistInfo, run_dir: Path, overrides: list[str], log: Optional[TextLog] = None) -> dict:
    """Build, resume, record, train. Nothing is written into ``run_dir`` until the start is
    accepted (the checkpoint loaded): a refused start leaves the folder as it was; then
    out.log gets the lines printed so far and every later one (``log``)."""
    refuse_other_world_early(cfg, info, run_dir)  # before the model: a world the checkpoints cannot split
    checkpointer = build_checkpointer(cfg, info, run_dir)
    loaded = load_checkpoint(cfg, info, run_dir, checkpointer)  # "resumed from ..." before the model and data lines
    torch.manual_seed(cfg.seed + info.rank)
    parts = build(cfg, info, run_dir, checkpointer)
    state = State()
    parts.overrides = overrides
    parts.guard.abort = lambda: _weights_abort_message(cfg, info, parts, state)
    changes = maybe_resume(cfg, info, parts, state, loaded)
    del loaded  # its tensors are in the model and optimizer now
    on_rank0(info, lambda: record_start(cfg, run_dir, overrides))
    if log is not None and info.is_main:
        log.open(run_dir)
    parts.logger.start(state.step, run_info(overrides, info), changes)
    # through the final checkpoint and eval (infclip.train.signals); the steps on the towers'
    # stream (data.decode_reserved_sms: SMs left free for the JPEG decoders' kernels). A stop
    # signal that a step blocked in a collective cannot act on ends the process after
    # dist.stop_grace_s; the final checkpoint and eval (after the last step) are never cut short
    pending = lambda: not state.stop_requested and state.step < cfg.steps  # noqa: E731
    with signals_handled(state, cfg.dist.stop_grace_s, pending), running_on(parts.towers):
        return fit(cfg, info, parts, state)


# ----------------------------------------------------------------------------- loop


def fit(cfg: Any, info: DistInfo, parts: Parts, state: State) -> dict:
    state.data_state = parts.data.state_dict()  # the position before any step of this process
    _warn_duplicates(cfg, info, parts)
    pipeline = build_step_pipeline(cfg, parts.data, parts.engine, info.device, info.world_size,
                                   _stall_watch(cfg, info, parts, state))
    parts.engine.next_feed = pipeline.peek  # a decoding normalizer starts on the next step during the replay
    parts.logger.set_start(state.step)
    _warn_unreached_diagnostics(cfg, info, parts, state)
    beat = _heartbeat(cfg, info, parts)
    t_run = time.perf_counter()
    try:
        while state.step < cfg.steps:
            try:
                if beat is not None:
                    beat.begin(state.step + 1, cfg.steps)
                with profiled_step(parts.run_dir, state.step + 1, info.rank, _profiled(cfg, state)) as profile, \
                        _decode_traced(cfg, info, parts, state):
                    metrics = train_step(cfg, info, parts, state, pipeline)
                if profile is not None:
                    on_rank0(info, lambda: print(f"profile: step {state.step + 1} in {profile} "
                                                 f"(trace beside it)", flush=True))
            except StoppedWaiting:  # single rank: abandon the step, stop as after the last one
                _abandon_step(state)
                state.stop_requested, state.stop_signal = True, state.signal_received
                break
            if beat is not None:
                beat.end()
            state.step_rng = None  # the step completed: nothing to rewind from here on
            state.step += 1
            state.samples += cfg.batch.global_size
            _after_step(cfg, info, parts, state, metrics)
            if state.stop_requested:
                break
    except LoaderStalled as e:
        raise _data_abort(info, parts, state, str(e), "Check the shard named (file system, pipe: command); "
                          "data.stall_abort_s sets how long to wait (0: for ever)") from None
    except RuntimeError as e:
        if not _loader_died(e):
            raise
        raise _data_abort(info, parts, state, f"a data loader worker died ({str(e).strip().splitlines()[0]})",
                          "If the system's out-of-memory killer ended it, lower data.workers or "
                          "data.loader_batch") from None
    finally:  # stop the loader workers now, also when a step raised (they ignore SIGTERM)
        pipeline.close()
        if beat is not None:
            beat.close()
            parts.engine.on_micro = None
    return _finish(cfg, info, parts, state, time.perf_counter() - t_run)


def _heartbeat(cfg: Any, info: DistInfo, parts: Parts) -> Optional[StepHeartbeat]:
    """The main rank's line every logging.heartbeat_s while a step runs longer (None: off)."""
    every = float(cfg.logging.heartbeat_s)
    if every == 0 or not info.is_main:
        return None
    locked = cfg.model.lock_image or cfg.model.lock_text  # a locked tower runs in the cache pass only
    beat = StepHeartbeat(every, lambda line: print(line, flush=True),
                         replay_weight=None if locked else REPLAY_WEIGHT)
    parts.engine.on_micro = beat.micro
    return beat.start()


def _profiled(cfg: Any, state: State) -> bool:
    """Whether the step about to run is logging.profile_step."""
    return cfg.logging.profile_step == state.step + 1


def _traced(cfg: Any, state: State) -> bool:
    """Whether the step about to run is logging.decode_trace_step."""
    return cfg.logging.decode_trace_step == state.step + 1


@contextmanager
def _decode_traced(cfg: Any, info: DistInfo, parts: Parts, state: State) -> Iterator[None]:
    """logging.decode_trace_step: the device decoder records the enclosed step's timeline;
    each rank writes it to <run_dir>/decode_trace/step_N_rank_r.json, rank 0 logs its summary
    (not when the step raised: a half step's timeline would mislead)."""
    start = getattr(parts.engine.normalizer, "start_trace", None)
    if not _traced(cfg, state) or start is None:
        yield
        return
    start()
    try:
        yield
    finally:
        trace = parts.engine.normalizer.stop_trace()
    step = state.step + 1
    path = parts.run_dir / "decode_trace" / f"step_{step}_rank_{info.rank}.json"
    failed = None
    try:  # a diagnostic file: failing to write it ends no run (and no rank alone)
        write_trace(path, step, trace)
    except OSError as e:
        failed = f"the timeline not written: {e}"
    if info.is_main:
        parts.logger.write(format_summary(step, trace) + f"\n  ({failed or f'the timeline: {path}'})")
    elif failed:
        print(f"warning: rank {info.rank}: logging.decode_trace_step: {failed}", flush=True)


def _warn_unreached_diagnostics(cfg: Any, info: DistInfo, parts: Parts, state: State) -> None:
    """logging.profile_step / decode_trace_step names a step this process will not run, or
    there is no device decoder to trace: say so at the start."""
    for key, what in (("profile_step", "profiled"), ("decode_trace_step", "traced")):
        n = getattr(cfg.logging, key)
        if n and not state.step < n <= cfg.steps:
            on_rank0(info, lambda: print(f"warning: logging.{key}={n} is outside the steps this run trains "
                                         f"({state.step + 1}..{cfg.steps}): no step is {what}", flush=True))
    if cfg.logging.decode_trace_step and not hasattr(parts.engine.normalizer, "start_trace"):
        on_rank0(info, lambda: print(f"warning: logging.decode_trace_step={cfg.logging.decode_trace_step} traces the "
                                     "device JPEG decoder, and this run decodes in the loader workers "
                                     f"(data.decode={cfg.data.decode}): nothing is traced", flush=True))


def _stall_watch(cfg: Any, info: DistInfo, parts: Parts, state: State) -> StallWatch:
    """A stalled loader is warned about and ends the run (data.stall_*). On one rank a stop
    signal is also honoured while waiting for data: the step is abandoned. Several ranks
    never abandon a step on a signal (the others finish it and wait for this one in the
    stop agreement); a rank whose loader stalls ends the job (torchrun stops the others)."""
    return StallWatch(cfg.data.stall_warn_s, cfg.data.stall_abort_s, parts.data.waiting_on,
                      warn=parts.logger.write,
                      stop_requested=None if info.distributed else (lambda: state.signal_received != 0))


def _abandon_step(state: State) -> None:
    """The step was left half done (no update applied): put the RNG back to its start, so a
    checkpoint now holds exactly the state after the last completed step."""
    if state.step_rng is not None:
        ckpt.set_rng_state(state.step_rng)


def _loader_died(e: RuntimeError) -> bool:
    """torch's error for a loader worker that exited or was killed (raised by its SIGCHLD
    handler or the loader's liveness check, or the step pipeline's LoaderDied)."""
    return str(e).lstrip().startswith("DataLoader worker")


def _data_abort(info: DistInfo, parts: Parts, state: State, what: str, advice: str) -> Exception:
    """The error (one paragraph, exit 2) of a stalled or dead loader; one rank first
    checkpoints its last completed step (several cannot: the others wait in a collective)."""
    from infclip.data.shards import DataError

    if info.distributed:
        where = f"rank {info.rank}: {what}; the other ranks wait for it: stopping the job without a new checkpoint"
    else:
        _abandon_step(state)
        saved = parts.checkpointer.root / f"step_{state.step:08d}"
        path = _save(parts, state) if state.saved_step != state.step else saved
        where = f"{what}; the last completed step ({state.step}) is checkpointed ({path})"
    return DataError(f"{where}. {advice}; resume=auto continues from the newest checkpoint.")


def train_step(cfg: Any, info: DistInfo, parts: Parts, state: State, pipeline: StepPipeline) -> dict:
    """One optimizer step on the pipeline's next feed. The GPU starts as soon as the feed's
    first micro-batch is there; ``time_data_wait`` is all the time the step blocked on data."""
    t0 = time.perf_counter()
    if not info.distributed:  # to abandon the step on a stop signal or a stalled loader
        state.step_rng = ckpt.rng_state()
    feed = pipeline.next()
    parts.model.train()
    lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
    # phase timings sync CUDA (a profiled or traced step too: its summary splits the step at the syncs)
    # (the same on every rank: the config and the step number decide it, and on several ranks a
    # timed step makes one more collective, the engine's rank_wait all-reduce)
    parts.engine.measure_timings = _logged(cfg, state.step + 1) or _profiled(cfg, state) or _traced(cfg, state)
    out = parts.engine.step_feed(_simclr_views(cfg, info, state, feed))
    feed.wait_complete()  # every row arrived, so the feed's data position is set
    state.data_state, wait = feed.data_state, feed.wait_s
    pipeline.release(feed, info.device)  # read before release: the filler then reuses the feed
    _maybe_inject_nan(parts, state.step + 1)
    t1 = time.perf_counter()
    applied, overflow, grad_norm = _optimizer_step(cfg, parts, out)
    if _profiled(cfg, state) and info.device.type == "cuda":
        torch.cuda.synchronize(info.device)  # the profile's optimizer phase holds its kernels
    mark_phase_end("optimizer")
    t_opt = time.perf_counter() - t1
    step_time = time.perf_counter() - t0
    return {
        "loss": float(out.global_loss), "lr": lr,
        "logit_scale": float(_unwrap(parts.model).logit_scale.detach().exp()), "grad_norm": grad_norm,
        "samples_per_s": cfg.batch.global_size / step_time,
        "samples_per_s_per_gpu": cfg.batch.global_size / step_time / info.world_size,
        "step_time": step_time, "time_data_wait": wait, "data_wait_pct": 100.0 * wait / step_time,
        "loader_samples_per_s": pipeline.loader_rate() * info.world_size, "time_optim": t_opt,
        **_cpu_decode_stats(cfg, info, pipeline),
        "host_image_bytes_per_sample": pipeline.image_bytes_per_sample(),
        **{f"time_{k}": v for k, v in out.timings.items()},
        "gpu_mem_gb": gpu_memory_gb(info.device), "skipped_step": int(not applied),
        "amp_overflow": int(overflow), **_decoder_stats(parts, step_time, out.timings.get("cache_pass")),
        **{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in out.metrics.items()},  # (0-d device counts)
    }


def _cpu_decode_stats(cfg: Any, info: DistInfo, pipeline: StepPipeline) -> dict:
    """data.cpu_decode_share: the samples/s the loader workers delivered decoded (beside the
    device decoder's ``decode_imgs_per_s``) and how many so far on this rank; nothing without it."""
    if not cfg.data.cpu_decode_share:
        return {}
    return {"loader_cpu_decoded_per_s": pipeline.cpu_decoded_rate() * info.world_size,
            "cpu_decoded_samples": pipeline.cpu_decoded}


def _decoder_stats(parts: Any, step_time: float, first_pass_s: Optional[float]) -> dict:
    """The device JPEG decoder's counters (data.decode=device): its images/s of decode work
    beside the loader's rate, the share of the step it worked (``decode_busy_pct``) and of
    the gradient cache's first pass (``decode_busy_first_pct``), fallbacks and drops."""
    stats = getattr(parts.engine.normalizer, "stats", None)
    if stats is None:
        return {}
    out = stats()
    out["decode_busy_pct"] = 100.0 * out.pop("decode_busy_s") / step_time
    first = out.pop("decode_busy_first_s", None)
    if first is not None and first_pass_s:
        out["decode_busy_first_pct"] = 100.0 * first / first_pass_s
    return out


def _simclr_views(cfg: Any, info: DistInfo, state: State, feed: Any) -> Any:
    """SimCLR: two augmented views of each image replace (image, caption), on the host."""
    if cfg.task != "simclr":
        return feed
    from infclip.train.simclr import step_seed, two_views

    images, tokens = two_views(feed.full("images"), step_seed(cfg.seed, state.step, info.rank))
    return TensorFeed({"images": images, "tokens": tokens})


def _warn_duplicates(cfg: Any, info: DistInfo, parts: Parts) -> None:
    msg = duplicate_warning(cfg.batch.global_size, parts.data.num_samples, info.world_size,
                            parts.data.spec.loader_batch, parts.data.spec.resampled)
    if msg and info.is_main:
        parts.logger.write(msg if msg.startswith("note: ") else f"warning: {msg}")


def _optimizer_step(cfg: Any, parts: Parts, out: Any) -> tuple[bool, bool, float]:
    """Unscale, clip, step. Returns (finite, amp_overflow, grad_norm).

    A non-finite loss or gradient skips the update. Under fp16 a GradScaler overflow (inf
    gradients while the scale calibrates) is normal: the scaler skips that step by itself and
    it is reported as ``amp_overflow``, not counted as a non-finite step.
    """
    opt, scaler = parts.optimizer, parts.scaler
    if scaler is not None:
        scaler.unscale_(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    # one host sync per step: the gradient norm, and the previous update's finite-weights flag
    grad_norm = parts.guard.fetch(torch.nn.utils.clip_grad_norm_(params, max_norm))
    loss_finite = math.isfinite(float(out.global_loss))
    finite = loss_finite and math.isfinite(grad_norm)
    overflow = False
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(opt)  # skips by itself on inf/nan gradients
        scaler.update()
        overflow = loss_finite and not finite and scaler.get_scale() < scale
        finite = finite or overflow
    elif finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    parts.scheduler.step()
    clamp_logit_scale(_unwrap(parts.model), cfg.model.max_logit_scale)
    parts.guard.after_update()  # resolved at the next sync: next step's grad norm, or a save/eval
    return finite, overflow, grad_norm


def _maybe_inject_nan(parts: Parts, step: int) -> None:
    """Test hooks: ``INFCLIP_INJECT_NAN_AT_STEPS=3,4,5`` poisons those steps' gradients;
    ``INFCLIP_INJECT_NAN_WEIGHTS_AT_STEPS=4`` puts a NaN into a weight during step 4, so the
    weights after its update are not finite (a corrupted update the loss cannot see yet)."""
    params = [p for g in parts.optimizer.param_groups for p in g["params"]]
    if _env_steps("INFCLIP_INJECT_NAN_AT_STEPS", step):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            grads[0].fill_(math.nan)
    if _env_steps("INFCLIP_INJECT_NAN_WEIGHTS_AT_STEPS", step) and params:
        with torch.no_grad():
            params[0].view(-1)[0] = math.nan


def _env_steps(name: str, step: int) -> bool:
    return str(step) in os.environ.get(name, "").replace(" ", "").split(",")


def _logged(cfg: Any, step: int) -> bool:
    """Steps whose metrics go to the terminal, the metrics file and wandb."""
    every = cfg.logging.every_n_steps
    return step == 1 or (every > 0 and step % every == 0) or step == cfg.steps


def _count_nonfinite(state: State, skipped: bool) -> None:
    state.nonfinite_run = state.nonfinite_run + 1 if skipped else 0
    state.nonfinite_total += int(skipped)


def _abort_if_nonfinite(cfg: Any, parts: Parts, state: State, loss: float) -> None:
    """Called after ``state.step`` counted the skipped step: it still consumed its data and
    its learning-rate slot, so a checkpoint at ``state.step`` resumes after it."""
    parts.logger.write(f"step {state.step}: non-finite loss/gradient (loss={loss}); update skipped")
    if state.nonfinite_run >= cfg.max_nonfinite:
        path = _save(parts, state)  # the weights are still the last good ones: no update was applied
        raise NonFiniteError(
            f"{state.nonfinite_run} consecutive non-finite steps (max_nonfinite={cfg.max_nonfinite}); "
            f"the last good state (weights after step {state.step - state.nonfinite_run}) is saved in {path}. "
            f"Lower optim.lr, use precision.amp=bf16, or check the data; to resume with a lower lr:\n  "
            + resume_command(parts.overrides, path, cfg.optim.lr / 10)
        )


def _weights_abort_message(cfg: Any, info: DistInfo, parts: Parts, state: State) -> str:
    """The guard's abort: the update of ``state.step`` made weights NaN/inf (nothing of it
    was saved); names the newest finite checkpoint and the command resuming it."""
    head = (f"the update of step {state.step} (optim.lr={cfg.optim.lr:g}) made the weights non-finite (NaN/inf); "
            "training stopped before saving or evaluating them.")
    path = last_finite_checkpoint(parts.run_dir, info.world_size)
    if path is None:
        return f"{head} No finite checkpoint exists yet: restart with a lower optim.lr (e.g. {cfg.optim.lr / 10:.3g})."
    return (f"{head} The newest finite checkpoint is {path}; resume from it with a lower lr:\n  "
            + resume_command(parts.overrides, path, cfg.optim.lr / 10))


def _after_step(cfg: Any, info: DistInfo, parts: Parts, state: State, metrics: dict) -> None:
    step = state.step
    parts.logger.progress(step, {"loss": metrics["loss"], "lr": metrics["lr"]})
    _hint_decode_bound(cfg, info, parts, state, metrics)
    skipped = bool(metrics["skipped_step"])
    _count_nonfinite(state, skipped)
    if _logged(cfg, step) or skipped:
        metrics["epoch"] = state.samples / max(parts.data.num_samples, 1)  # passes over the data so far
        metrics["skipped_samples"] = sum(_skip_counts(state, info).values())
        metrics["nonfinite_steps"] = state.nonfinite_total
        parts.logger.log(step, metrics)
    if skipped:
        _abort_if_nonfinite(cfg, parts, state, metrics["loss"])
    if eval_due(parts.eval_cfg, step) and step != cfg.steps:
        evaluate(cfg, info, parts, step, final=False)
    _agree_on_stop(state, info)
    every_ckpt = cfg.checkpoint.every_n_steps
    if state.stop_requested or (every_ckpt and step % every_ckpt == 0):
        _save(parts, state)


def _hint_decode_bound(cfg: Any, info: DistInfo, parts: Parts, state: State, metrics: dict) -> None:
    """Once a run, on the main rank: say when the device decoder bounds the step and the SM
    reserve for its kernels is off."""
    if state.decode_hinted or not info.is_main or "decode_busy_pct" not in metrics:
        return
    msg = decode_bound_hint(metrics["decode_busy_pct"], cfg.data.decode_reserved_sms, state.step,
                            metrics.get("decode_busy_first_pct", float("nan")))
    if msg:
        parts.logger.write(msg)
        state.decode_hinted = True


def _agree_on_stop(state: State, info: DistInfo) -> None:
    """All ranks stop after the same step, for the same reason: the largest signal number any
    rank received (SIGTERM 15 over SIGUSR1 10), so rank 0 requeues only if no rank was told to
    terminate, even when the warning reached only some ranks. The handler never sets
    ``stop_requested`` itself: a signal landing after this all-reduce would otherwise make one
    rank leave the loop while the others start the next step (and hang in its collectives)."""
    agreed = state.signal_received
    if info.distributed:
        t = torch.tensor([agreed], device=info.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        agreed = int(t.item())
    if agreed:
        state.stop_requested, state.stop_signal = True, agreed


def _skip_counts(state: State, info: DistInfo) -> dict[str, int]:
    """Skipped samples/shards by reason up to the last trained step (prefetched data not
    counted yet), summed over all ranks (called on every rank)."""
    local = dict((state.data_state or {}).get("skips", {}))
    if not info.distributed:
        return local
    gathered: list = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, local)
    total: dict[str, int] = {}
    for counts in gathered:
        for reason, n in counts.items():
            total[reason] = total.get(reason, 0) + n
    return total


# ----------------------------------------------------------------------------- end, save


def _finish(cfg: Any, info: DistInfo, parts: Parts, state: State, wall: float) -> dict:
    """Final checkpoint first, then the final eval: a signal or a failure in the eval loses
    no step (the stop-signal handlers stay installed through both)."""
    evals = "the final eval" if not state.stop_requested and parts.eval_cfg.tasks else "the run's summary"
    if state.saved_step != state.step:  # never rewrite a complete checkpoint of the same step
        state.finishing = f"the final checkpoint, then {evals}"
        _save(parts, state)
    state.finishing = evals
    final = {} if state.stop_requested else evaluate(cfg, info, parts, state.step, final=True)
    skips = _skip_counts(state, info)
    summary = {"steps": state.step, "wall_s": wall, "nonfinite_steps": state.nonfinite_total,
               "skipped_samples": skips, **final}
    parts.logger.log(state.step, {"summary": summary}, echo=False)
    _print_summary(parts, summary, state)
    if info.is_main:
        _draw_curves(parts)
    parts.logger.close()
    if state.stop_signal == signal.SIGUSR1 and state.step < cfg.steps and info.is_main:
        slurm.requeue()  # Slurm's warning signal (not a user's SIGTERM): come back and resume
    return summary


def _print_summary(parts: Parts, summary: dict, state: State) -> None:
    w = parts.logger.write
    why = "stopped by signal" if state.stop_requested else "done"
    total, starts = parts.logger.run_time()
    first = parts.logger.first_step
    mine = (f"steps {first + 1}-{summary['steps']} in {summary['wall_s']:.1f} s in this process, {summary['steps']} "
            f"steps in {total:.1f} s over {starts} starts" if starts > 1 and first < summary["steps"]
            else f"{summary['steps']} steps in {summary['wall_s']:.1f} s")
    again = "; run the same command to resume" if state.stop_requested and state.step < parts.logger.total else ""
    w(f"== {why}: {mine}; run dir {parts.run_dir}{again}")
    w(f"   skipped samples: {summary['skipped_samples'] or 'none'}; non-finite steps: {summary['nonfinite_steps']}")
    for k, v in summary.items():
        if k.startswith("eval/") and not k.endswith(_BOOKKEEPING):
            chance = summary.get(f"{k}_chance")
            w(f"   {k:<40} {v:8.4f}" + (f"   (chance {chance:.4f})" if chance is not None else ""))


def _draw_curves(parts: Parts) -> None:
    """The learning curve and eval metrics as <run_dir>/curves.png (infclip.plot); a plot
    that cannot be drawn is one line, never a failed run."""
    from infclip.plot import PlotError, plot_run

    try:
        parts.logger.write(f"   curves: {plot_run(parts.run_dir)}")
    except PlotError as e:
        parts.logger.write(f"   curves: not drawn ({e})")
    except Exception as e:  # a plotting library's failure must not fail a finished run
        parts.logger.write(f"   curves: not drawn ({type(e).__name__}: {str(e).strip()[:200]})")


def _save(parts: Parts, state: State) -> Path:
    """Checkpoint of ``state.step``; the guard first confirms the weights are finite."""
    parts.guard.check()
    model = _unwrap(parts.model)
    train_state = {
        "step": state.step, "samples": state.samples, "nonfinite_total": state.nonfinite_total,
        "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "config": parts.config,
    }
    rank_state = {"rng": ckpt.rng_state(), "data": state.data_state}
    path = parts.checkpointer.save(state.step, model.state_dict(), train_state, rank_state)
    state.saved_step = state.step
    parts.logger.write(f"checkpoint: {path}")
    return path
