"""Wordle-like: guess a hidden word, with per-letter feedback after every guess (multi-turn).

Made for the tiny character model on two CPU cores: short words over a small alphabet, and every
symbol of the game is one token of the character tokenizer (primebuild/runtime/models/char_tokenizer.py).

An episode, as the model sees it (`<eos>` ends each model turn; the environment's tokens are masked
out of the loss):

    <bos> >  abc<eos>  xzy>  dbe<eos>  zzz ...

- prompt `>`: the game starts (the hidden word is the task; nothing else is shown);
- a model turn is a guess: exactly `word_length` letters of `alphabet`;
- the environment answers with one mark per letter, then `>`: `z` the letter is at this position,
  `y` it is in the word elsewhere, `x` it is not (more), as in Wordle (exact matches first, then each
  remaining letter of the word is claimed once, left to right).

The episode ends when the word is guessed, after `max_guesses` guesses, or on an invalid guess.
Reward: 1 for a first-guess solve, `max_guesses` - `t` + 1 over `max_guesses` for a solve at guess t
(each guess costs 1/max_guesses), 0 unsolved or invalid. Solving in fewer guesses is what RL can
improve over the SFT start, whose demonstrations guess uniformly among the words still consistent with
all feedback.

Held-out split as in reverse-text: a word is an eval word iff CRC32(word) % EVAL_BUCKETS == 0;
training never draws one.
"""

from __future__ import annotations

import itertools
import random
import zlib

from primebuild.errors import UserError
from primebuild.runtime.envs.base import ENVIRONMENT, MODEL, Task
from primebuild.runtime.models.char_tokenizer import LETTERS, SEPARATOR

ENV_ID = "wordle"
ENV_VERSION = "1"
EVAL_BUCKETS = 5
EXACT, ELSEWHERE, ABSENT = "z", "y", "x"
MARKS = (EXACT, ELSEWHERE, ABSENT)


def feedback(guess: str, secret: str) -> str:
    """One mark per letter of `guess` (Wordle's rule for repeated letters)."""
    marks = [ABSENT] * len(guess)
    left: dict[str, int] = {}
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = EXACT
        else:
            left[s] = left.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != EXACT and left.get(g, 0) > 0:
            marks[i] = ELSEWHERE
            left[g] -= 1
    return "".join(marks)


def is_eval_word(word: str) -> bool:
    return zlib.crc32(word.encode()) % EVAL_BUCKETS == 0


class WordleEpisode:
    def __init__(self, secret: str, alphabet: str, max_guesses: int):
        self.secret, self.alphabet, self.max_guesses = secret, alphabet, max_guesses
        self.guesses: list[str] = []
        self.solved = self.invalid = False

    async def step(self, completion: str) -> str | None:
        guess = completion.strip()
        if len(guess) != len(self.secret) or any(c not in self.alphabet for c in guess):
            self.invalid = True
            return None
        self.guesses.append(guess)
        if guess == self.secret:
            self.solved = True
            return None
        if len(self.guesses) >= self.max_guesses:
            return None
        return feedback(guess, self.secret) + SEPARATOR

    async def reward(self) -> float:
        if not self.solved:
            return 0.0
        return (self.max_guesses - len(self.guesses) + 1) / self.max_guesses

    async def close(self) -> None:
        pass


class WordleEnv:
    """See the module docstring."""

    id = ENV_ID
    version = ENV_VERSION

    def __init__(self, word_length: int = 3, alphabet: str = "abcdef", max_guesses: int = 6, num_eval: int = 100):
        if not isinstance(word_length, int) or not 1 <= word_length <= 8:
            raise UserError(f"environment {ENV_ID}: word_length must be an integer in 1..8, got {word_length!r}")
        if not isinstance(alphabet, str) or len(set(alphabet)) != len(alphabet) or len(alphabet) < 2 \
                or any(c not in LETTERS or c in MARKS for c in alphabet):
            raise UserError(f"environment {ENV_ID}: alphabet must be >= 2 distinct lowercase letters other than "
                            f"the marks {'/'.join(MARKS)}, got {alphabet!r}")
        if not isinstance(max_guesses, int) or max_guesses < 1:
            raise UserError(f"environment {ENV_ID}: max_guesses must be a positive integer, got {max_guesses!r}")
        self.word_length, self.alphabet, self.max_guesses = word_length, alphabet, max_guesses
        self.max_turns = max_guesses
        words = ["".join(w) for w in itertools.product(alphabet, repeat=word_length)]
        self._train = [w for w in words if not is_eval_word(w)]
        eval_words = [w for w in words if is_eval_word(w)]
        if not self._train or len(eval_words) < num_eval:
            raise UserError(f"environment {ENV_ID}: {len(words)} words hold {len(eval_words)} held-out ones, fewer "
                            f"than num_eval={num_eval}", hint="lower num_eval or use a larger alphabet or word_length")
        random.Random(20240601).shuffle(eval_words)
        self._eval = [Task(prompt="", answer=w) for w in sorted(eval_words[:num_eval])]

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [Task(prompt="", answer=rng.choice(self._train)) for _ in range(n)]

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def format_prompt(self, task: Task) -> str:
        return SEPARATOR

    def score(self, task: Task, completion: str) -> float:
        """A single guess scored as an episode of one turn (used only by single-turn callers)."""
        return 1.0 if completion.strip() == task.answer else 0.0

    def start(self, task: Task) -> WordleEpisode:
        return WordleEpisode(task.answer, self.alphabet, self.max_guesses)

    def demonstration(self, task: Task, rng: random.Random) -> list[tuple[bool, str]]:
        """Guess uniformly among the words consistent with every mark so far, until solved."""
        words, table = self._feedback_table()
        secret = words.index(task.answer)
        candidates = list(range(len(words)))
        segments: list[tuple[bool, str]] = []
        for turn in range(self.max_guesses):
            guess = rng.choice(candidates)
            segments.append((MODEL, words[guess]))
            if guess == secret or turn == self.max_guesses - 1:
                break
            code = table[guess][secret]
            segments.append((ENVIRONMENT, feedback(words[guess], task.answer) + SEPARATOR))
            candidates = [w for w in candidates if table[guess][w] == code]
        return segments

    def _feedback_table(self):
        """Every word, and the feedback of every guess on every secret as small ints (built once: SFT
        draws ~4 demonstrations' worth of filtering per task, ~1 s a batch in pure Python without it)."""
        if getattr(self, "_table", None) is None:
            import numpy as np

            words = ["".join(w) for w in itertools.product(self.alphabet, repeat=self.word_length)]
            letters = np.array([[self.alphabet.index(c) for c in w] for w in words])  # [N, L]
            table = np.zeros((len(words), len(words)), dtype=np.int32)
            for g, guess in enumerate(letters):
                exact = letters == guess  # [N, L]: secret letter == guess letter at that position
                left = np.zeros((len(words), len(self.alphabet)), dtype=np.int32)
                for i in range(self.word_length):
                    np.add.at(left, (np.arange(len(words)), letters[:, i]), ~exact[:, i])
                code = np.zeros(len(words), dtype=np.int32)
                for i, letter in enumerate(guess):
                    mark = np.where(exact[:, i], 2, 0)
                    elsewhere = ~exact[:, i] & (left[:, letter] > 0)
                    mark = np.where(elsewhere, 1, mark)
                    left[:, letter] -= elsewhere
                    code = code * 3 + mark
                table[g] = code
            self._words, self._table = words, table.tolist()
        return self._words, self._table
