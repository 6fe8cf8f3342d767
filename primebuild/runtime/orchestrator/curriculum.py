"""The curriculum (orchestrator.curriculum): prompts sampled from easy / normal / hard pools by their recent
pass rate.

- Prompts: each environment's training prompts are a fixed set of `prompts` distinct tasks (by prompt and
  answer), drawn once from the run's seed (`prompt_set`), so a prompt comes back and its pass rate means
  something. The plan draws the same set to refuse an environment that has fewer (builders/curriculum.py).
- Pass rate: the mean reward of a prompt's last `window` finished groups (every finished group counts,
  the equal-reward ones the difficulty filter sets aside included: they say most about difficulty).
- Pools: pass rate >= easy_at is easy, <= hard_at is hard, between is normal; a prompt not yet sampled is
  normal. A prompt moves only when it is sampled again.
- Sampling: every `groups_per_step` consecutive groups split over the pools by `mix` exactly (largest
  remainder, the slots shuffled per step from the seed); within a pool a prompt is drawn uniformly among
  those of the group's environment not already running. A pool with no such prompt lends the slot to the
  next one (easy -> normal -> hard, hard -> normal -> easy, normal -> hard -> easy), counted as borrowed.
- Resume: the pass-rate history is written beside each batch (run_dir/curriculum.json) and read back.
"""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path

from primebuild.contracts.orchestrator import CURRICULUM_POOLS as POOLS
from primebuild.contracts.orchestrator import CurriculumConfig
from primebuild.contracts.run_dir import write_json_atomic
from primebuild.errors import UserError
from primebuild.runtime.envs.base import Environment, Task
from primebuild.runtime.orchestrator.mixture import split

# Where a slot goes when its pool has no prompt to give: the nearest difficulty first.
LENDERS = {"easy": ("normal", "hard"), "normal": ("hard", "easy"), "hard": ("normal", "easy")}
# A prompt set is drawn with at most this many draws per prompt asked for: enough to collect a finite
# set's every task (coupon collector: n ln n draws for n tasks, ~7 n for n = 1000), and it bounds the
# search in an environment that has fewer distinct tasks than asked.
DRAWS_PER_PROMPT = 20
# A group drawn this many steps' worth of groups before a batch's newest is in no later batch (staleness
# and the difficulty filter's budget end it long before): its record is forgotten.
FORGET_AFTER_STEPS = 256


def prompt_key(task: Task) -> str:
    """What makes two tasks the same prompt (wordle's prompt is always empty: its answer tells them apart)."""
    return json.dumps([task.prompt, task.answer])


def prompt_set(env: Environment, n: int, seed: int, index: int) -> list[Task]:
    """Environment number `index`'s `n` distinct training tasks for a run of `seed` (fewer when it has fewer)."""
    rng = random.Random(f"curriculum/{seed}/{index}")
    found: dict[str, Task] = {}
    for _ in range(DRAWS_PER_PROMPT * n):
        (task,) = env.sample_tasks(rng, 1)
        found.setdefault(prompt_key(task), task)
        if len(found) == n:
            break
    return list(found.values())


def pool_of(rate: float | None, easy_at: float, hard_at: float) -> str:
    if rate is None:
        return "normal"
    if rate >= easy_at:
        return "easy"
    if rate <= hard_at:
        return "hard"
    return "normal"


class Curriculum:
    def __init__(self, cfg: CurriculumConfig, envs: list[Environment], names: list[str], seed: int,
                 groups_per_step: int):
        self.cfg, self.names, self.seed, self.groups_per_step = cfg, names, seed, groups_per_step
        self.tasks: list[list[Task]] = []
        for i, (env, name) in enumerate(zip(envs, names, strict=True)):
            tasks = prompt_set(env, cfg.prompts, seed, i)
            if len(tasks) < cfg.prompts:  # the plan refuses this for the environments it can load
                raise UserError(f"orchestrator.curriculum.prompts: environment {name} has {len(tasks)} distinct "
                                f"training prompts, fewer than the {cfg.prompts} asked for",
                                hint=f"set orchestrator.curriculum.prompts to at most {len(tasks)}")
            self.tasks.append(tasks)
        self.keys = [[prompt_key(t) for t in tasks] for tasks in self.tasks]
        # per environment: prompt key -> the mean rewards of its last `window` groups
        self.history: list[dict[str, deque[float]]] = [{} for _ in envs]
        self.running: list[dict[str, int]] = [{} for _ in envs]  # groups of each prompt in flight
        self.drawn: dict[int, tuple[int, str, str]] = {}  # group seq -> (environment, key, pool it came from)
        self.borrowed = 0  # slots since the last batch whose pool had nothing to give

    # --- pools -----------------------------------------------------------------------------------

    def pass_rate(self, env: int, key: str) -> float | None:
        rewards = self.history[env].get(key)
        return sum(rewards) / len(rewards) if rewards else None

    def pool(self, env: int, key: str) -> str:
        return pool_of(self.pass_rate(env, key), self.cfg.easy_at, self.cfg.hard_at)

    def members(self, env: int) -> dict[str, list[int]]:
        """Each pool's prompts (indices into the environment's prompt set, in set order)."""
        out: dict[str, list[int]] = {p: [] for p in POOLS}
        for i, key in enumerate(self.keys[env]):
            out[self.pool(env, key)].append(i)
        return out

    def sizes(self) -> dict[str, int]:
        out = dict.fromkeys(POOLS, 0)
        for env in range(len(self.tasks)):
            for pool, members in self.members(env).items():
                out[pool] += len(members)
        return out

    # --- sampling --------------------------------------------------------------------------------

    def slot_pool(self, seq: int) -> str:
        """The pool group `seq`'s slot asks for: each step's groups split over the pools exactly by mix."""
        weights = [self.cfg.mix[p] for p in POOLS]
        slots = [p for p, count in zip(POOLS, split(self.groups_per_step, weights), strict=True) for _ in range(count)]
        random.Random(f"curriculum-slots/{self.seed}/{seq // self.groups_per_step}").shuffle(slots)
        return slots[seq % self.groups_per_step]

    def draw(self, seq: int, env: int) -> Task:
        """The task of group `seq` of environment number `env` (the mix of environments chose it)."""
        wanted = self.slot_pool(seq)
        members = self.members(env)
        rng = random.Random(f"curriculum-draw/{self.seed}/{seq}")
        running = self.running[env]
        order = (wanted, *LENDERS[wanted])
        for pool in order:
            idle = [i for i in members[pool] if not running.get(self.keys[env][i])]
            if idle:
                break
        else:  # every prompt is running (the plan refuses a set smaller than the groups in flight)
            pool = next(p for p in order if members[p])
            idle = members[pool]
        self.borrowed += pool != wanted
        i = rng.choice(idle)
        key = self.keys[env][i]
        running[key] = running.get(key, 0) + 1
        self.drawn[seq] = (env, key, pool)
        return self.tasks[env][i]

    def finished(self, seq: int, rewards: list[float]) -> None:
        """Group `seq` finished with these rewards: its prompt's pass rate moves."""
        env, key, _ = self.drawn[seq]
        history = self.history[env].setdefault(key, deque(maxlen=self.cfg.window))
        history.append(sum(rewards) / len(rewards))
        self.ended(seq)

    def ended(self, seq: int) -> None:
        """Group `seq` no longer runs (finished, failed, dropped or cancelled)."""
        if seq not in self.drawn:  # forgotten: its prompt's running count was settled long ago
            return
        env, key, _ = self.drawn[seq]
        running = self.running[env]
        if running.get(key, 0) > 0:
            running[key] -= 1

    def step_metrics(self, seqs: list[int]) -> dict[str, float]:
        """The pools' sizes now, and how many of a batch's groups (`seqs`) each pool gave."""
        out = {f"curriculum_{p}": n for p, n in self.sizes().items()}
        sampled = [self.drawn[s][2] for s in seqs if s in self.drawn]
        out.update({f"curriculum_sampled_{p}": sampled.count(p) for p in POOLS})
        out["curriculum_borrowed"] = self.borrowed
        self.borrowed = 0
        for s in seqs:  # a batched group is never asked about again
            self.drawn.pop(s, None)
        if seqs:  # nor one this far behind (set aside, dropped or failed long ago): the map stays small
            oldest = max(seqs) - FORGET_AFTER_STEPS * self.groups_per_step
            self.drawn = {s: d for s, d in self.drawn.items() if s >= oldest}
        return out

    # --- resume ----------------------------------------------------------------------------------

    def save(self, path: Path, step: int) -> None:
        write_json_atomic(path, {"step": step, "window": self.cfg.window,
                                 "history": {name: {k: list(v) for k, v in h.items()}
                                             for name, h in zip(self.names, self.history, strict=True)}})

    def load(self, path: Path) -> int | None:
        """Read the pass rates saved with a batch; the step they were saved with (None: no file)."""
        if not path.is_file():
            return None
        saved = json.loads(path.read_text())
        for name, history in zip(self.names, self.history, strict=True):
            for key, rewards in saved["history"].get(name, {}).items():
                history[key] = deque(rewards, maxlen=self.cfg.window)
        return saved["step"]
