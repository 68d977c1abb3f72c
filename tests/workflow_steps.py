"""A workflow's `run:` steps, executed as a GitHub runner executes them: the step's own script, read from
.github/workflows/*.yml, run by `bash -e` (GitHub's default shell on Linux) in the step's working
directory, with the step's `env:` evaluated from the job's contexts (`${{ inputs.pr }}`, `${{ github.token }}`,
`${{ a || b }}` ...) and the variables a runner sets (GITHUB_EVENT_PATH, RUNNER_TEMP, GITHUB_OUTPUT ...).

What cannot exist here is stood in for, and only that: GitHub's API is tests/github_fake.py (real HTTP);
`python` on the PATH is this interpreter; `sudo` is a stand-in for the GPU runner's sudoers rule
(docs/RUNBOOK.md, "The GPU runner"), which lets the runner's user run `/opt/muse/venv/bin/python -m pipeline
evaluate --official ...` or `... serving evaluate --official ...` as root and nothing else: the stand-in
refuses any other command, keeps the environment (the rule's env_keep), and runs that venv's python as
this interpreter. The harness's checkout is the repository these tests run from (PYTHONPATH), the data's
checkout (results/, leaderboard.md) is the step's working directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
RUNNER_VENV_PYTHON = "/opt/muse/venv/bin/python"

# The runner's sudoers rule (docs/RUNBOOK.md): exactly these commands, as root, the environment kept.
SUDO_STAND_IN = f"""#!/bin/sh
# the GPU runner's sudoers rule, standing in for sudo (tests/workflow_steps.py)
[ "$1" = "-n" ] || {{ echo "sudo: the workflow must not prompt (sudo -n)" >&2; exit 1; }}
shift
[ "$1" = "{RUNNER_VENV_PYTHON}" ] && [ "$2" = "-m" ] && [ "$3" = "pipeline" ] || {{
  echo "sudo: a password is required (the runner's sudoers rule allows only {RUNNER_VENV_PYTHON} -m pipeline)" >&2; exit 1; }}
case "$4 $5 $6" in
  "evaluate --official "*|"serving evaluate --official") ;;
  *) echo "sudo: a password is required (not the rule's command: $4 $5 $6)" >&2; exit 1 ;;
esac
shift
exec "{sys.executable}" "$@"
"""


def load(workflow: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / workflow).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Step:
    workflow: str
    job: str
    name: str
    run: str
    env: dict[str, str]
    working_directory: str | None


def steps(workflow: str) -> list[Step]:
    out = []
    for job_id, job in load(workflow)["jobs"].items():
        for s in job.get("steps", []):
            if "run" in s:
                out.append(Step(workflow, job_id, s.get("name", ""), s["run"], {k: str(v) for k, v in
                                                                                 (s.get("env") or {}).items()},
                                s.get("working-directory")))
    return out


def step(workflow: str, job: str, name: str) -> Step:
    """The step of `job` whose name starts with `name` (exactly one)."""
    found = [s for s in steps(workflow) if s.job == job and s.name.startswith(name)]
    assert len(found) == 1, f"{workflow}: job {job} has {len(found)} steps named {name!r}..."
    return found[0]


def pipeline_steps() -> list[Step]:
    """Every step of every workflow that runs a verb of the pipeline."""
    return [s for wf in sorted(p.name for p in WORKFLOWS.glob("*.yml")) for s in steps(wf)
            if re.search(r"(^|[\s/])python3? -m pipeline\s", s.run)]


# ---- GitHub's expressions (the part of the language the workflows' env: blocks use) ----

_TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>-?\d+(?:\.\d+)?)|(?P<op>\|\||&&|==|!=|!|\(|\))"
                    r"|(?P<path>[A-Za-z_][\w-]*(?:\.[A-Za-z_*][\w-]*)*))")


def evaluate(expr: str, contexts: dict[str, Any]) -> Any:
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot read the expression {expr!r} at {expr[pos:]!r}")
        tokens.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    tokens.append(("end", ""))
    i = 0

    def peek() -> tuple[str, str]:
        return tokens[i]

    def take() -> tuple[str, str]:
        nonlocal i
        i += 1
        return tokens[i - 1]

    def truthy(v: Any) -> bool:
        return v not in (None, False, 0, "")

    def primary() -> Any:
        kind, text = take()
        if kind == "str":
            return text[1:-1].replace("''", "'")
        if kind == "num":
            return float(text) if "." in text else int(text)
        if (kind, text) == ("op", "("):
            v = either()
            assert take() == ("op", ")"), expr
            return v
        if (kind, text) == ("op", "!"):
            return not truthy(primary())
        if kind == "path":
            if text in ("true", "false", "null"):
                return {"true": True, "false": False, "null": None}[text]
            node: Any = contexts
            for part in text.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            return node
        raise ValueError(f"unexpected {text!r} in {expr!r}")

    def equality() -> Any:
        left = primary()
        while peek() in (("op", "=="), ("op", "!=")):
            _, op = take()
            right = primary()
            same = (left.lower() == right.lower() if isinstance(left, str) and isinstance(right, str)
                    else left == right)
            left = same if op == "==" else not same
        return left

    def both() -> Any:
        left = equality()
        while peek() == ("op", "&&"):
            take()
            right = equality()
            left = right if truthy(left) else left
        return left

    def either() -> Any:
        left = both()
        while peek() == ("op", "||"):
            take()
            right = both()
            left = left if truthy(left) else right
        return left

    value = either()
    if peek()[0] != "end":
        raise ValueError(f"trailing {peek()[1]!r} in {expr!r}")
    return value


def render(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def interpolate(text: str, contexts: dict[str, Any]) -> str:
    return re.sub(r"\$\{\{(.*?)\}\}", lambda m: render(evaluate(m.group(1), contexts)), text)


# ---- a job's runner ----

@dataclass
class Job:
    """The machine one job runs on: a workspace, RUNNER_TEMP, the event that started the workflow, the
    contexts its expressions read (`inputs` is the dispatch's, from the event), and `api` (the GitHub
    stand-in's environment: GITHUB_API_URL, GITHUB_REPOSITORY ...). `host_env` holds what the runner's
    host sets for every job (PIPELINE_* paths of a self-hosted runner)."""
    root: Path
    event: dict[str, Any]
    api: dict[str, str] = field(default_factory=dict)
    vars: dict[str, str] = field(default_factory=dict)
    step_outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    host_env: dict[str, str] = field(default_factory=dict)
    sha: str = "0" * 40
    run_id: int = 4242

    def __post_init__(self) -> None:
        self.workspace = self.root / "workspace"
        self.temp = self.root / "runner-temp"
        self.bin = self.root / "bin"
        for d in (self.workspace, self.temp, self.bin):
            d.mkdir(parents=True, exist_ok=True)
        self.event_path = self.root / "event.json"
        self.event_path.write_text(json.dumps(self.event))
        (self.bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (self.bin / "sudo").write_text(SUDO_STAND_IN)
        for shim in ("python", "sudo"):
            (self.bin / shim).chmod(0o755)
        self.output = self.temp / "github_output"
        self.summary = self.temp / "step_summary.md"

    def contexts(self) -> dict[str, Any]:
        return {"github": {"token": self.api.get("GITHUB_TOKEN", "test-token"), "sha": self.sha, "event": self.event,
                           "repository": self.api.get("GITHUB_REPOSITORY", ""), "ref": "refs/heads/main",
                           "run_id": self.run_id},
                "inputs": self.event.get("inputs", {}), "vars": self.vars,
                "steps": {k: {"outputs": v} for k, v in self.step_outputs.items()},
                "runner": {"temp": str(self.temp)}}

    def run(self, s: Step, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run the step's script as the runner would; returns the finished process (text output)."""
        contexts = self.contexts()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "RUNNER_"))}
        env.update(self.host_env)
        env.update(self.api)
        env.update(CI="true", GITHUB_ACTIONS="true", GITHUB_EVENT_PATH=str(self.event_path),
                   GITHUB_WORKSPACE=str(self.workspace), RUNNER_TEMP=str(self.temp), GITHUB_OUTPUT=str(self.output),
                   GITHUB_STEP_SUMMARY=str(self.summary), GITHUB_SHA=self.sha, GITHUB_RUN_ID=str(self.run_id),
                   GITHUB_SERVER_URL="https://github.com",
                   PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                              else [])))
        env.update({k: interpolate(v, contexts) for k, v in s.env.items()})
        script = self.root / f"step-{abs(hash((s.workflow, s.job, s.name)))}.sh"
        script.write_text(interpolate(s.run, contexts))
        cwd = self.workspace / s.working_directory if s.working_directory else self.workspace
        return subprocess.run(["bash", "-e", str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
