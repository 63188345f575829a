"""The GPU campaign in one command: environment and ceilings, correctness on the compiled kernels,
the attention sweep against transformers, FlexAttention and SDPA-flash, the pretraining step, the
autotuner's choices and plots — time-boxed, every failure recorded, a summary table last.

    python -m bench.campaign --out DIR [--budget-min 20] [--quick] [--steps env correctness sweep pretrain memory plots]
                             [--sweep-D 64 128] [--sweep-providers xlnet_fast sdpa_flash ...]
    python -m bench.campaign --out DIR --cpu-dry-run [--budget-min 3]   # the orchestration on CPU, tiny shapes
    python -m bench.campaign --report RECORDS.jsonl [MORE.jsonl ...] [--out DIR]

Steps (``bench.campaign_steps`` has what each measures in each mode):
a. ``env``: device, SM count, versions; the bf16 matmul (TFLOP/s) and device-to-device copy (GB/s)
   ceilings measured on random data;
b. ``correctness``: the suite's GPU tests in a subprocess without ``TRITON_INTERPRET`` (the
   compiled kernels pinned to one config, ``bench.pinned_configs``; the bf16 convergence test of the
   transformers patch; pytest-xdist workers compile in parallel where installed), then
   ``bench.gpu_check``'s comparison with float64 (bf16 and fp16, content and two-stream, mlen 384,
   qlen 512 and 4096, D 128, the deterministic backward; then the two-stream case at each
   autotuner config in turn), errors recorded against the suite's tolerance;
c. ``sweep``: the providers of ``bench.attention`` side by side on the same tensors per shape,
   forward and forward+backward, D=64 first; CUDA-event medians, TFLOP/s (4·B·H·M·K·D, x2.5 for
   fwd+bwd), peak memory, OOM recorded as OOM; the providers' forward outputs compared once per D;
d. ``pretrain``: the XLNet two-stream pretraining step (seq 512, mem 384, 85 targets, bf16 autocast),
   tokens/s and peak memory, xlnet_fast against transformers, base then large;
e. the autotuner's winning config (and every config's time) per tuned shape, recorded as steps b–d
   tune;
f. ``plots``: ``attention.png`` (c) and ``pretrain.png`` (d);
g. ``memory``: Transformer-XL evaluation with memory against a recomputed sliding context of the
   same attention length (``bench.memory_reuse``, 128…3,800), and generation with memory against
   recomputing the context (``bench.generation``, Transformer-XL and XLNet), tokens/s and ratios.

Each step runs in its own process, gets a share of ``--budget-min`` (what an earlier step left is
shared among the later ones), stops starting new items when its share is used up (a ``cut`` record
names what did not run) and is killed if it is still running a little after that; a crash, a lost
CUDA context or an exception is recorded (traceback in the log) and the next step runs. Everything
goes under DIR, in at most ``MAX_FILES`` files: ``campaign.jsonl`` (one record per line: ``run``,
``step``, ``op``, ``status`` — ok, error, skipped, cut or oom — ``t`` in seconds, then the op's
fields), ``campaign.log`` (progress, tracebacks, the test output), ``summary.md`` (the table printed
last) and the two plots. DIR must not already hold a campaign's files.

``--quick``: the smallest shapes, a couple of minutes on a GPU (a smoke test on arrival). Without
CUDA the campaign refuses unless ``--cpu-dry-run``: tiny shapes on CPU, the Triton kernels in
Triton's interpreter, the eager providers, and what needs CUDA recorded as ``skipped: needs CUDA``.
``--report`` prints the summary and the README's tables from records (several files: e.g. the
two parts of a session), and with ``--out DIR`` writes ``summary.md`` and the plots there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import campaign_report, runner
from bench.attention import PROVIDERS

ROOT = Path(__file__).resolve().parents[1]
RECORDS_FILE = "campaign.jsonl"
LOG_FILE = "campaign.log"
SUMMARY_FILE = "summary.md"
ATTENTION_PLOT = "attention.png"
PRETRAIN_PLOT = "pretrain.png"
OUTPUT_FILES = (RECORDS_FILE, LOG_FILE, SUMMARY_FILE, ATTENTION_PLOT, PRETRAIN_PLOT)
MAX_FILES = 8  # what the GPU machine sends back
STEPS = ("env", "correctness", "sweep", "pretrain", "memory", "plots")
# Shares of the budget; "plots" runs at the end in the time kept back (RESERVE_*).
WEIGHTS = {"env": 0.04, "correctness": 0.34, "sweep": 0.44, "pretrain": 0.18, "memory": 0.12}
RESERVE_FRACTION, RESERVE_MAX_S = 0.04, 20.0
# A step whose share is below this is not started (a cut record says so).
MIN_STEP_S = 2.0
# A step still running this long after its deadline is killed: max(GRACE_MIN_S, GRACE_FRACTION x share).
GRACE_MIN_S, GRACE_FRACTION, GRACE_MAX_S = 5.0, 0.1, 30.0
INJECTABLE = "a step name (it raises), crash:STEP (its process dies), or OP:PROVIDER / OP (that item raises)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for the campaign's files (required unless --report)")
    p.add_argument("--budget-min", type=float, default=20.0, help="minutes for the whole campaign (default 20)")
    p.add_argument("--quick", action="store_true", help="smallest shapes: a couple of minutes, a smoke test")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the orchestration on CPU with tiny shapes (interpreter and eager providers)")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run, in order")
    p.add_argument("--sweep-D", type=int, nargs="+", metavar="D",
                   help="the sweep's head dims instead of the mode's (e.g. 128 for a follow-up call)")
    p.add_argument("--sweep-providers", nargs="+", choices=PROVIDERS, metavar="P",
                   help=f"the sweep's providers instead of the mode's, among {', '.join(PROVIDERS)}")
    p.add_argument("--report", type=Path, nargs="+", metavar="RECORDS",
                   help="print the summary and README tables of these campaign.jsonl files")
    p.add_argument("--inject-failure", action="append", default=[], metavar="WHAT",
                   help=f"test the failure handling: {INJECTABLE}")
    p.add_argument("--child", choices=STEPS[:-1], help=argparse.SUPPRESS)  # run one step (internal)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's deadline, time.time()
    return p


def _mode(args) -> str:
    return "dry" if args.cpu_dry_run else "quick" if args.quick else "full"


def _existing_outputs(out: Path) -> list:
    return [name for name in OUTPUT_FILES if (out / name).exists()]


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group this campaign started (a step, or the test suite a step started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# The parent: shares, child processes, records, log, summary
# --------------------------------------------------------------------------------------------------


class Campaign:
    """Runs the steps as child processes and owns the output files (the only writer)."""

    def __init__(self, out: Path, budget_s: float, mode: str, steps: list, failures: list,
                 sweep_D: list | None = None, sweep_providers: list | None = None):
        self.out, self.mode, self.steps, self.failures = out, mode, steps, failures
        self.sweep_D, self.sweep_providers = sweep_D, sweep_providers
        self.t0 = time.time()
        self.end = self.t0 + budget_s
        self.reserve = min(RESERVE_MAX_S, RESERVE_FRACTION * budget_s)
        self.run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.t0)) + f"-{os.getpid()}"
        self.records: list = []
        self.device = None
        self.child = None
        self.child_groups: set = set()  # process groups the running step started (its test suite)
        self._lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)
        self._log = open(out / LOG_FILE, "a", buffering=1)
        self._jsonl = open(out / RECORDS_FILE, "a", buffering=1)

    def log(self, text: str, console: bool = True) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {text}"
        with self._lock:
            self._log.write(line + "\n")
        if console:
            print(line, file=sys.stderr, flush=True)

    def add(self, step: str, rec: dict) -> dict:
        rec = {"run": self.run_id, "step": step, "t": round(time.time() - self.t0, 2), **rec}
        rec.setdefault("device", self.device)
        self.device = rec.get("device") or self.device
        with self._lock:
            self._jsonl.write(json.dumps(rec, default=str) + "\n")
            self.records.append(rec)
        return rec

    def share(self, step: str, remaining: list) -> float:
        """Seconds for ``step``: the time left (less the reserve) split by weight among the steps left."""
        weights = [WEIGHTS[s] for s in remaining if s in WEIGHTS]
        left = self.end - self.reserve - time.time()
        return max(0.0, left * WEIGHTS[step] / sum(weights)) if weights else 0.0

    def run(self) -> int:
        self.log(f"campaign {self.run_id}: mode {self.mode}, budget {(self.end - self.t0) / 60:.1f} min, steps "
                 f"{' '.join(self.steps)}, writing to {self.out}")
        try:
            for i, step in enumerate(self.steps):
                if step in WEIGHTS:
                    self.run_step(step, self.share(step, self.steps[i:]))
        except KeyboardInterrupt:
            self._stop_child()
            self.add("campaign", {"op": "interrupted", "status": "cut", "reason": "interrupted (SIGINT/SIGTERM)"})
            self.log("interrupted: writing what was measured")
        finally:
            self.finish()
        return 1 if any(r.get("status") == "error" for r in self.records) else 0

    # -- one step in a child process --------------------------------------------------------------

    def _child_command(self, step: str, deadline: float) -> list:
        cmd = [sys.executable, "-m", "bench.campaign", "--child", step, "--deadline", f"{deadline:.3f}"]
        cmd += {"dry": ["--cpu-dry-run"], "quick": ["--quick"], "full": []}[self.mode]
        for what in self.failures:
            cmd += ["--inject-failure", what]
        for flag, values in (("--sweep-D", self.sweep_D), ("--sweep-providers", self.sweep_providers)):
            if values:
                cmd += [flag, *map(str, values)]
        return cmd

    def _child_env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if self.mode == "dry":
            env["TRITON_INTERPRET"] = "1"  # the kernels in Triton's interpreter on CPU
        else:
            env.pop("TRITON_INTERPRET", None)  # the compiled kernels
        return env

    def _read_child(self, step: str, stream, counts: dict) -> None:
        from bench.campaign_steps import GROUP_PREFIX, LOG_PREFIX, RECORD_PREFIX

        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith(GROUP_PREFIX):
                self.child_groups.add(int(line[len(GROUP_PREFIX):]))
            elif line.startswith(RECORD_PREFIX):
                try:
                    rec = self.add(step, json.loads(line[len(RECORD_PREFIX):]))
                except json.JSONDecodeError:
                    self.log(f"{step}: unreadable record line: {line[:200]}")
                    continue
                counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            elif line.startswith(LOG_PREFIX):
                self.log(line[len(LOG_PREFIX):], console=False)
            else:
                self.log(f"{step}: {line}")

    def run_step(self, step: str, share: float) -> None:
        t_start, counts = time.time(), {}
        if share < MIN_STEP_S:
            self.log(f"cut: step {step} not started: {share:.1f} s of the budget left for it")
            self.add(step, {"op": "step", "status": "cut", "seconds": 0.0, "share_s": round(share, 1), "records": 0,
                            "note": "not started: the budget was used up", "reason": "no time left", "not_run": [step]})
            return
        grace = min(GRACE_MAX_S, max(GRACE_MIN_S, GRACE_FRACTION * share))
        self.log(f"step {step}: {share:.0f} s (killed {grace:.0f} s after that if still running)")
        self.child = subprocess.Popen(self._child_command(step, t_start + share), cwd=ROOT, env=self._child_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        reader = threading.Thread(target=self._read_child, args=(step, self.child.stdout, counts), daemon=True)
        reader.start()
        killed = False
        try:
            returncode = self.child.wait(timeout=share + grace)
        except subprocess.TimeoutExpired:
            self._stop_child()
            returncode, killed = self.child.wait(), True
        if returncode != 0:
            self._stop_groups()  # what a killed or crashed step left running
        reader.join(timeout=10)
        self.child, self.child_groups = None, set()
        self._step_record(step, share, time.time() - t_start, returncode, killed, counts)

    def _step_record(self, step, share, seconds, returncode, killed, counts) -> None:
        notes = [f"{n} {s}" for s, n in sorted(counts.items())]
        if killed:
            self.add(step, {"op": "step_killed", "status": "cut", "reason": f"still running {seconds - share:.0f} s "
                            "after its share of the budget: killed", "not_run": ["the rest of the step"]})
            notes.append("killed at its deadline")
        elif returncode != 0:
            self.add(step, {"op": "step_process", "status": "error",
                            "error": f"the step's process exited with status {returncode} (its output is in the log)"})
            notes.append(f"process exit status {returncode}")
        errors = counts.get("error", 0) or (returncode != 0 and not killed)
        status = "error" if errors else "cut" if killed or counts.get("cut") else "ok"
        why = {"error": {"error": ", ".join(notes)}, "cut": {"reason": ", ".join(notes)}}.get(status, {})
        self.add(step, {"op": "step", "status": status, "seconds": round(seconds, 1), "share_s": round(share, 1),
                        "records": sum(counts.values()), "note": ", ".join(notes), **why})
        self.log(f"step {step}: {status} after {seconds:.0f} s ({', '.join(notes) or 'no records'})")

    def _stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            _kill_group(self.child.pid)  # the process group this campaign started
        self._stop_groups()

    def _stop_groups(self) -> None:
        for pgid in self.child_groups:
            _kill_group(pgid)

    # -- the end -----------------------------------------------------------------------------------

    def _plots(self) -> None:
        t = time.time()
        plots = ((ATTENTION_PLOT, campaign_report.plot_attention), (PRETRAIN_PLOT, campaign_report.plot_pretrain))
        for name, fn in plots:
            try:
                if fn(self.records, self.out / name):
                    self.add("plots", {"op": "plot", "status": "ok", "file": name})
                else:
                    self.add("plots", {"op": "plot", "status": "skipped", "file": name, "reason": "no records to plot"})
            except Exception as exc:  # noqa: BLE001 - recorded; the summary is still written
                import traceback

                self.log("ERROR in plots:\n" + traceback.format_exc().rstrip())
                self.add("plots", {"op": "plot", "status": "error", "file": name,
                                   "error": f"{type(exc).__name__}: {exc}"})
        self.add("plots", {"op": "step", "status": "ok", "seconds": round(time.time() - t, 1), "share_s": None,
                           "records": 2, "note": ""})

    def finish(self) -> None:
        if "plots" in self.steps:
            self._plots()
        used = time.time() - self.t0
        title = f"GPU campaign {self.run_id} ({self.mode}; {used / 60:.1f} of {(self.end - self.t0) / 60:.1f} min)"
        _atomic_text(self.out / SUMMARY_FILE, campaign_report.summary_markdown(self.records, title=title))
        files = sorted(p.name for p in self.out.iterdir())
        self.log(f"wrote {len(files)} files to {self.out}: {', '.join(files)}")
        self._log.close()
        self._jsonl.close()
        print(campaign_report.summary_markdown(self.records, title=title, compact=True), flush=True)


# --------------------------------------------------------------------------------------------------
# A child: one step
# --------------------------------------------------------------------------------------------------


def child_main(args) -> int:
    """Run one step, reporting on stdout (``bench.campaign_steps.Reporter``)."""
    import bench.source_tree

    bench.source_tree.ensure_kernels_importable()
    import torch

    from bench import campaign_steps

    mode = _mode(args)
    device = "cuda" if mode != "dry" and torch.cuda.is_available() else "cpu"
    r = campaign_steps.Reporter(args.deadline, device, tuple(args.inject_failure))
    r.env = {**runner.environment(), **({"device": "cpu"} if device == "cpu" else {})}
    if f"crash:{args.child}" in args.inject_failure:
        os._exit(70)  # a process that dies without a word, as on a fatal CUDA error
    plan = campaign_steps.PLANS[mode]
    if args.sweep_D:
        plan = dataclasses.replace(plan, sweep_D=tuple(args.sweep_D))
    if args.sweep_providers:
        plan = dataclasses.replace(plan, providers=tuple(args.sweep_providers))
    try:
        r._inject(args.child, {})
        campaign_steps.STEPS[args.child](r, plan)
    except Exception as exc:  # noqa: BLE001 - recorded; the parent goes on with the next step
        r.failed(args.child, exc)
        return 1
    return 3 if r.cuda_lost else 0


# --------------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------------


def report_main(args) -> int:
    missing = [str(p) for p in args.report if not p.is_file()]
    if missing:
        return runner.refuse(f"bench.campaign --report: no such file: {', '.join(missing)}")
    records, notes = campaign_report.load_records(args.report)
    text = campaign_report.summary_markdown(records, notes, title=f"GPU campaign: {', '.join(map(str, args.report))}")
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            return runner.refuse(f"bench.campaign --report: --out {args.out} is not a folder")
        clash = _existing_outputs(args.out) if args.out.exists() else []
        if clash:
            return runner.refuse(f"bench.campaign --report: {args.out} already holds {', '.join(clash)}; "
                                 "choose another folder")
        args.out.mkdir(parents=True, exist_ok=True)
        _atomic_text(args.out / SUMMARY_FILE, text)
        campaign_report.plot_attention(records, args.out / ATTENTION_PLOT)
        campaign_report.plot_pretrain(records, args.out / PRETRAIN_PLOT)
    print(text)
    print("## README tables\n")
    print(campaign_report.readme_tables(records))
    return 0


def _usage_problem(args) -> str | None:
    if args.out is None:
        return "bench.campaign: --out DIR is required"
    if not args.budget_min > 0:
        return f"bench.campaign: --budget-min must be positive, got {args.budget_min}"
    if args.quick and args.cpu_dry_run:
        return "bench.campaign: --quick and --cpu-dry-run exclude each other"
    if args.sweep_D and not all(0 < d <= 128 for d in args.sweep_D):
        return f"bench.campaign: --sweep-D takes head dims in 1..128 (the kernels' limit), got {args.sweep_D}"
    if args.out.exists() and not args.out.is_dir():
        return f"bench.campaign: --out {args.out} exists and is not a folder"
    clash = _existing_outputs(args.out) if args.out.exists() else []
    if clash:
        return f"bench.campaign: {args.out} already holds {', '.join(clash)} of another run; choose another folder"
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child_main(args)
    if args.report:
        return report_main(args)
    problem = _usage_problem(args)
    if problem:
        return runner.refuse(problem)
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        return runner.refuse("bench.campaign: no CUDA device here; --cpu-dry-run runs the campaign's orchestration "
                             "on CPU with tiny shapes")
    steps = [s for s in STEPS if s in args.steps]
    campaign = Campaign(args.out.resolve(), args.budget_min * 60, _mode(args), steps, args.inject_failure,
                        args.sweep_D, args.sweep_providers)
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return campaign.run()
    finally:
        signal.signal(signal.SIGTERM, before)


def _interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
