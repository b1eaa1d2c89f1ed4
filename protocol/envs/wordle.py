"""The built-in `wordle` environment (version 1): guess a hidden five-letter word in six turns.

An episode: the first observation explains the game and asks for a guess; each model turn is
one line (stop "\\n") whose first five-letter word is the guess; the environment answers with
per-letter feedback (`G` right letter and place, `Y` in the word elsewhere, `.` absent, with
Wordle's rule for repeated letters) and asks again, until the word is found or six guesses are
spent. Replies are a pure function of the secret and the guesses, so validators replay them.

Rewards (weights): `solved_reward` 1.0 when a guess is the secret (1.0), `letters_reward` 0.5
(partial credit: the best guess's (greens + yellows / 2) / 5), `format_reward` 0.1 (the share of
turns whose line holds a five-letter word). Total in [0, 1.6].

Secrets come from `wordle_words.WORDS` (shipped in the package); a fixed hash assigns one word
in eight to the held-out split, so evaluation never asks a training word.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, PromptSpec, check_seed_index
from swarmrl.protocol.envs.episode import EpisodeEnv, Reply
from swarmrl.protocol.envs.wordle_words import WORDS

MAX_GUESSES = 6
_WORD = re.compile(r"[A-Za-z]{5}")
INTRO = ("Let's play Wordle. Guess the secret five-letter word in at most 6 guesses. After each guess "
         "you get one symbol per letter: G = right letter, right place; Y = in the word, wrong place; "
         ". = not in the word.\nGuess:")


def is_heldout_word(word: str) -> bool:
    """Whether `word` belongs to the held-out split (one in eight, by a fixed hash)."""
    return hashlib.sha256(f"wordle-v1:{word}".encode()).digest()[0] < 32


TRAIN_WORDS = tuple(w for w in WORDS if not is_heldout_word(w))
HELDOUT_WORDS = tuple(w for w in WORDS if is_heldout_word(w))


def parse_guess(turn: str) -> str | None:
    """The guess of one model turn: the first five-letter run of letters on its first line,
    lower-cased (a longer word gives None), or None."""
    line = turn.strip().split("\n", 1)[0]
    for token in re.findall(r"[A-Za-z]+", line):
        return token.lower() if _WORD.fullmatch(token) else None
    return None


def feedback(secret: str, guess: str) -> str:
    """Wordle's per-letter feedback, e.g. feedback("crane", "caret") == "GY.Y.".

    Greens first; then each other letter is Y while the secret has unmatched copies of it left.
    """
    out = ["."] * 5
    left = Counter(s for s, g in zip(secret, guess, strict=True) if s != g)
    for i, (s, g) in enumerate(zip(secret, guess, strict=True)):
        if s == g:
            out[i] = "G"
        elif left[g] > 0:
            out[i] = "Y"
            left[g] -= 1
    return "".join(out)


def play(secret: str, turns: Sequence[str]) -> Reply:
    """The environment's answer after `turns` (pure: replayable)."""
    guess = parse_guess(turns[-1])
    if guess == secret:
        return Reply("", done=True)
    if len(turns) >= MAX_GUESSES:
        return Reply("", done=True)
    if guess is None:
        return Reply(" (not a five-letter word)\nGuess:", done=False)
    return Reply(f"{feedback(secret, guess)}\nGuess:", done=False)


def _guesses(turns: Sequence[str]) -> list[str | None]:
    return [parse_guess(t) for t in turns]


def solved_reward(prompts: list[str], completions: list[str], secret: list[str], turns: list[list[str]],
                  **kwargs: Any) -> list[float | None]:
    """1.0 when some guess of the episode is the secret, else 0.0."""
    return [1.0 if s in _guesses(ts) else 0.0 for s, ts in zip(secret, turns, strict=True)]


def letters_reward(prompts: list[str], completions: list[str], secret: list[str], turns: list[list[str]],
                   **kwargs: Any) -> list[float | None]:
    """Partial credit: max over the guesses of (greens + yellows / 2) / 5 (0.0 with no guess)."""
    out: list[float | None] = []
    for s, ts in zip(secret, turns, strict=True):
        best = 0.0
        for g in _guesses(ts):
            if g is not None:
                fb = feedback(s, g)
                best = max(best, (fb.count("G") + 0.5 * fb.count("Y")) / 5)
        out.append(best)
    return out


def format_reward(prompts: list[str], completions: list[str], turns: list[list[str]],
                  **kwargs: Any) -> list[float | None]:
    """The share of the episode's turns that hold a five-letter guess (0.0 with no turn)."""
    return [sum(g is not None for g in _guesses(ts)) / len(ts) if ts else 0.0 for ts in turns]


class WordleEnv(EpisodeEnv):
    """Wordle; see the module docstring."""

    name = "wordle"
    version = "1"
    reward_funcs = (solved_reward, letters_reward, format_reward)
    reward_weights = (1.0, 0.5, 0.1)
    reward_range = (0.0, 1.6)
    regrade_tolerance = 1e-6
    stop = ("\n",)
    max_new_tokens = 8
    max_turns = MAX_GUESSES

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The episode at (seed, index): a secret drawn by `random.Random(f"wordle-v1:{seed}:{index}")`
        from the index's split; the text is the game's introduction.

        Raises:
            ValueError: negative seed or index outside [0, 2**63).
        """
        check_seed_index(seed, index)
        words = HELDOUT_WORDS if index >= HELDOUT_START else TRAIN_WORDS
        secret = random.Random(f"wordle-v1:{seed}:{index}").choice(words)
        return PromptSpec(index=index, text=INTRO, info={"secret": secret})

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        """Feedback on the last guess, or the end (solved or six guesses spent)."""
        return play(str(spec.info["secret"]), turns)

    def scripted_turn(self, spec: PromptSpec, turns: Sequence[str]) -> str:
        """The reference player: opens with "crane", then names the secret."""
        return " crane\n" if not turns else f" {spec.info['secret']}\n"

    @staticmethod
    def solved(info: dict[str, Any], turns: Sequence[str]) -> bool:
        """Whether the episode found the word (for `swarmrl eval`)."""
        return info["secret"] in _guesses(turns)
