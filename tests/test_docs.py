"""The README's and the guides' commands run, so the documentation cannot drift (issue 30).

The convention, for README.md and docs/*.md (not the generated reports under docs/results/): every
fenced ```bash and ```python block has, on the line right above its opening fence, one marker:

    <!-- runnable -->                 this test runs every command in the block, made tiny (below)
    <!-- not-runnable: REASON -->     not run here, and REASON says why (ImageNet, a GPU, a cluster, hours)

(HTML comments: rendered Markdown does not show them.) A runnable ```python block runs as one script.
In a runnable ```bash block each line is one command (a trailing `\\` continues it, `# ...` is a
comment), and only `python SCRIPT.py ARGS` and `python -m MODULE ARGS` may appear. The test
- appends the overrides in TINY for that program (after the documented ones, so they win): one
  epoch, two steps, eight samples;
- gives each run a folder of its own under a temporary dir (hydra.run.dir, or hydra.sweep.dir for
  `-m`, unless the command names hydra.run.dir itself); relative paths such as `--out` land there too;
- fills in placeholders, reading README.md and then docs/*.md by name: RUN_DIR is the run dir of the
  latest earlier training run of the same script (in `hydra.run.dir=RUN_DIR`, which continues a run:
  of the same command without it), SAMPLES.npz the samples.npz of the latest train_dit.py run,
  REF.npz a reference batch of digits, RUN_DIRS... every run dir so far;
- asserts exit code 0 and the file the command promises: results.json (in each job of a sweep),
  samples.png of a DiT run that samples, the benchmark's --out file, the report's REPORT.md, the
  scores of `python -m visattn.metrics` on stdout.
A command written twice (README and a guide) runs once. All commands run in one helper process (this
file run as a script), which runs each as `python ...` would (runpy with sys.argv set, in the temporary
dir; SystemExit's code is the exit code), so torch is imported once and the module takes well under 40 s.

Relative links in README.md and docs/*.md must resolve to files (and #anchors to headings).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(runnable|not-runnable)\s*(?::\s*(.*?))?\s*-->$")
CHECKED_LANGUAGES = {"bash", "sh", "shell", "python"}

# Appended to each program's documented arguments. Hydra and argparse both let the last value win.
TINY = {
    "train_cls.py": [
        "train.epochs=1", "sched.warmup_epochs=0", "train.batch_size=128",
        "train.amp=none", "train.tensorboard=false", "train.progress=false",
    ],
    "train_dit.py": [
        "train.steps=2", "train.batch_size=8", "train.amp=none", "train.log_every=1", "train.tensorboard=false",
        "train.progress=false", "eval.num_samples=8", "eval.head_load_images=16", "sample.steps=4",
        "sample.num_samples=8", "sample.batch_size=8", "sample.grid=8",
    ],
    "visattn.bench attention": ["--shapes", "2,16,32,2", "--dtypes", "fp32", "--repeats", "1", "--warmup", "0",
                                "--threads", "1"],
    "visattn.bench model": ["--presets", "vit_digits", "--batch", "2", "--dtypes", "fp32", "--repeats", "1",
                            "--warmup", "0", "--threads", "1"],
    "visattn.metrics": [],
    "visattn.report": [],
}


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    language: str
    marker: str | None  # "runnable" | "not-runnable" | None
    reason: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    where: str
    text: str  # as documented
    kind: str  # "script" | "module" | "python"
    target: str  # script name, module name, or the python source
    argv: list[str] = field(default_factory=list)
    run_dir: Path | None = None  # Hydra entry points: the run dir, or the sweep dir of `-m`
    sweep: bool = False
    jobs: int = 1  # a sweep's number of jobs
    key: tuple = ()


def fenced_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, end = i, i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        above = lines[start - 1].strip() if start > 0 else ""
        mark = MARKER.match(above)
        blocks.append(Block(doc, start + 1, m.group(1).lower(), mark and mark.group(1),
                            mark and mark.group(2), "\n".join(lines[start + 1:end])))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in fenced_blocks(doc) if b.language in CHECKED_LANGUAGES]


def bash_commands(block: Block) -> list[tuple[str, list[str]]]:
    """(documented text, words) per command: `\\` joins lines, `#` starts a comment."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = pending + raw, ""
        words = shlex.split(line, comments=True)
        if words:
            out.append((line.strip(), words))
    return out


def plan_commands(tmp: Path) -> dict[str, list[Command]]:
    """Every runnable command per doc, placeholders filled, tiny overrides appended, run dirs given;
    a command equal to an earlier one is the same Command object (it runs once)."""
    per_doc: dict[str, list[Command]] = {}
    latest: dict[str, Path] = {}  # script -> the run dir of its latest training run
    by_args: dict[tuple, Path] = {}  # (script, arguments) -> the run dir of its latest training run
    every_run: list[Path] = []
    seen: dict[tuple, Command] = {}
    for block in all_blocks():
        if block.marker != "runnable":
            continue
        doc = str(block.doc.relative_to(ROOT))
        if block.language == "python":
            cmd = Command(block.where, block.text, "python", block.text, key=("python", block.text))
            per_doc.setdefault(doc, []).append(seen.setdefault(cmd.key, cmd))
            continue
        for text, words in bash_commands(block):
            assert words[0] == "python" and len(words) >= (3 if words[1:2] == ["-m"] else 2), (
                f"{block.where}: a runnable block may hold only `python SCRIPT.py ...` or `python -m MODULE ...`"
                f" commands, not {text!r} (mark the block not-runnable with a reason)")
            kind, target, args = ("module", words[2], words[3:]) if words[1] == "-m" else ("script", words[1], words[2:])
            tiny = next((k for k in (f"{target} {args[0]}" if args else "", target) if k in TINY), None)
            assert tiny, f"{block.where}: no tiny overrides for {target!r} (add them to TINY)"
            args = fill(args, target, latest, by_args, every_run, tmp, block.where)
            key = (kind, target, tuple(args))
            if key not in seen:
                seen[key] = new_command(block.where, text, kind, target, args, TINY[tiny], tmp / "runs" / f"{len(seen):02d}")
            cmd = seen[key]
            per_doc.setdefault(doc, []).append(cmd)
            if cmd.run_dir is not None:
                if cmd.run_dir not in every_run:
                    every_run.append(cmd.run_dir)
                mode = [a.split("=", 1)[1] for a in args if a.startswith("mode=")]
                if not cmd.sweep and mode[-1:] in ([], ["train"]):
                    latest[target] = cmd.run_dir
                    by_args[(target, tuple(a for a in args if not a.startswith("hydra.run.dir=")))] = cmd.run_dir
    return per_doc


def new_command(where: str, text: str, kind: str, target: str, args: list[str], tiny: list[str],
                run_dir: Path) -> Command:
    cmd = Command(where, text, kind, target)
    if kind == "module":
        cmd.argv = [*args, *tiny]
        return cmd
    cmd.sweep = "-m" in args or "--multirun" in args
    named = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    if named:
        cmd.run_dir, extra = Path(named[-1]), []
    else:
        cmd.run_dir, extra = run_dir, [f"hydra.{'sweep' if cmd.sweep else 'run'}.dir={run_dir}"]
    cmd.argv = [*args, *tiny, *extra]
    if cmd.sweep:
        cmd.jobs = 1
        for a in args:
            if "=" in a and not a.startswith("hydra"):
                cmd.jobs *= len(a.split("=", 1)[1].split(","))
    return cmd


def fill(args: list[str], target: str, latest: dict[str, Path], by_args: dict[tuple, Path],
         every_run: list[Path], tmp: Path, where: str) -> list[str]:
    """The placeholders of the module docstring, filled in."""
    out = []
    for arg in args:
        if arg == "RUN_DIRS...":
            assert every_run, f"{where}: RUN_DIRS... before any run"
            out += [str(p) for p in every_run]
            continue
        if "SAMPLES.npz" in arg:
            assert "train_dit.py" in latest, f"{where}: SAMPLES.npz before any train_dit.py run"
            arg = arg.replace("SAMPLES.npz", str(latest["train_dit.py"] / "samples.npz"))
        arg = arg.replace("REF.npz", str(tmp / "reference.npz"))
        if arg == "hydra.run.dir=RUN_DIR":  # continuing a run: the same command's run
            same = (target, tuple(a for a in args if a != arg))
            assert same in by_args, f"{where}: continues a run of `{' '.join(same[1])}` that no earlier block made"
            arg = f"hydra.run.dir={by_args[same]}"
        elif "RUN_DIR" in arg:
            assert target in latest, f"{where}: RUN_DIR before any earlier training run of {target}"
            arg = arg.replace("RUN_DIR", str(latest[target]))
        out.append(arg)
    return out


# ---------------------------------------------------------------------------------------------- runs

def write_reference(path: Path) -> None:
    """A digits reference batch (the held-out split) for REF.npz, in ADM's format (arr_0)."""
    import numpy as np

    from visattn.data.sets.digits import load_digits_arrays

    images, _ = load_digits_arrays("test")
    np.savez(path, images.astype(np.uint8))


def run_all(tmp: Path, commands: list[Command]) -> dict[int, dict]:
    """Run the commands in one helper process; {id(command): {"rc", "log", "seconds"}}."""
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    plan = []
    for i, cmd in enumerate(commands):
        plan.append({"id": i, "kind": cmd.kind, "target": cmd.target, "argv": cmd.argv,
                     "log": str(tmp / "logs" / f"{i:02d}.log")})
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(tmp / "plan.json"), str(tmp / "done.jsonl")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    results = {}
    if (tmp / "done.jsonl").exists():
        for line in (tmp / "done.jsonl").read_text().splitlines():
            r = json.loads(line)
            results[id(commands[r["id"]])] = r
    for i, cmd in enumerate(commands):  # the helper died before these: its own output says why
        results.setdefault(id(cmd), {"rc": None, "log": plan[i]["log"], "seconds": None,
                                     "helper": (done.returncode, done.stderr[-3000:])})
    return results


def expected_outputs(cmd: Command, tmp: Path, log: str) -> list[str]:
    """What is missing of what the command promises."""
    def value(option: str) -> Path:
        out = Path(cmd.argv[len(cmd.argv) - cmd.argv[::-1].index(option)])  # the last one given
        return out if out.is_absolute() else tmp / out

    missing = []
    if cmd.kind == "script":
        jobs = [p for p in cmd.run_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if cmd.sweep else []
        dirs = sorted(jobs) if cmd.sweep else [cmd.run_dir]
        if cmd.sweep and len(dirs) != cmd.jobs:
            missing.append(f"{cmd.jobs} sweep jobs under {cmd.run_dir} (found {len(dirs)})")
        for d in dirs:
            if not (d / "results.json").is_file():
                missing.append(str(d / "results.json"))
            elif cmd.target == "train_dit.py":
                results = json.loads((d / "results.json").read_text())
                samples = results.get("mode") == "sample" or results.get("num_samples")
                if samples and not (d / "samples.png").is_file():
                    missing.append(str(d / "samples.png"))
    elif cmd.target == "visattn.bench" and "--out" in cmd.argv and not value("--out").is_file():
        missing.append(str(value("--out")))
    elif cmd.target == "visattn.report" and not (value("--out") / "REPORT.md").is_file():
        missing.append(str(value("--out") / "REPORT.md"))
    elif cmd.target == "visattn.metrics" and '"fid"' not in Path(log).read_text():
        missing.append("the scores (JSON with fid) on stdout")
    return missing


# ---------------------------------------------------------------------------------------------- tests

def test_every_command_block_is_marked():
    """Nothing drifts silently: each bash/python block is runnable (and run) or says why it is not."""
    unmarked = [b.where for b in all_blocks() if b.marker is None]
    assert not unmarked, (f"fenced blocks without <!-- runnable --> or <!-- not-runnable: REASON --> on the "
                          f"line above (see tests/test_docs.py): {unmarked}")
    no_reason = [b.where for b in all_blocks() if b.marker == "not-runnable" and not (b.reason or "").strip()]
    assert not no_reason, f"not-runnable without a reason: {no_reason}"


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("experiment", ["dit_recipe", "dit_tiny_3k"])
def test_the_dit_recipes_the_docs_name_compose_and_validate(experiment):
    """docs/generation.md names them in a block too long to run; their configs are checked here."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from visattn.engine.dit.setup import validate_dit_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("train_dit", overrides=[f"+experiment={experiment}"]), resolve=True)
    validate_dit_config(cfg)
    assert cfg["train"]["batch_size"] == 256 and cfg["train"]["steps"] in (3000, 400000)


def github_anchor(heading: str) -> str:
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_resolve():
    link = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        assert str(ROOT) not in text and str(Path.home()) + "/" not in text, f"{doc.name}: a path of this machine"
        for target in link.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            assert not path.startswith("/"), f"{doc.name}: absolute link {target}"
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = [github_anchor(h) for h in re.findall(r"^#+\s+(.*)$", dest.read_text(), re.M)]
                if anchor not in headings:
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    per_doc = plan_commands(tmp)
    unique = list({id(c): c for cmds in per_doc.values() for c in cmds}.values())
    if any(c.target == "visattn.metrics" for c in unique):
        write_reference(tmp / "reference.npz")
    return tmp, per_doc, run_all(tmp, unique) if unique else {}


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCS])
def test_runnable_commands_run(doc, doc_runs):
    tmp, per_doc, results = doc_runs
    failures = []
    for cmd in per_doc.get(doc, []):
        r = results[id(cmd)]
        log = Path(r["log"]).read_text()[-3000:] if Path(r["log"]).exists() else ""
        if r["rc"] != 0:
            failures.append(f"{cmd.where}: `{cmd.text}` exited {r['rc']}\n{log}\n{r.get('helper', '')}")
            continue
        missing = expected_outputs(cmd, tmp, r["log"])
        if missing:
            failures.append(f"{cmd.where}: `{cmd.text}` did not write {missing}\n{log}")
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------------- helper

def _helper(plan_file: str, done_file: str) -> None:
    """Run each planned command as `python ...` would, output to its log; one JSON line per command."""
    import runpy

    plan = json.loads(Path(plan_file).read_text())
    for item in plan:
        start = time.perf_counter()
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(item["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            rc = 0
            try:
                if item["kind"] == "python":
                    sys.argv = ["-c"]
                    exec(compile(item["target"], "<doc block>", "exec"), {"__name__": "__main__"})
                elif item["kind"] == "module":
                    sys.argv = [item["target"], *item["argv"]]
                    runpy.run_module(item["target"], run_name="__main__", alter_sys=True)
                else:
                    script = str(ROOT / item["target"])
                    sys.argv = [script, *item["argv"]]
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - any failure is this command's exit code 1
                import traceback

                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        with open(done_file, "a") as done:
            done.write(json.dumps({"id": item["id"], "rc": rc, "log": item["log"],
                                   "seconds": round(time.perf_counter() - start, 2)}) + "\n")


if __name__ == "__main__":
    _helper(*sys.argv[1:3])
