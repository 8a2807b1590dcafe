"""Synthetic prompts and the word-to-token rule shared by the load generator and the twin server.

The twin has no tokenizer: it counts a text prompt as `round(words * 1.3)` tokens (English text
averages about 1.3 tokens per word with Llama-style tokenizers). The load generator sizes its
prompts with the inverse rule, so a requested input length arrives within one token of itself.
A prompt given as a list of token ids counts exactly. Against a real engine, whose tokenizer splits
filler words its own way, the load generator first asks the engine's `/tokenize` what each filler
word costs and draws words that sum to the requested length (`Prompts`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

# Common short words; a seeded random draw keeps prompts distinct (no accidental prefix-cache hits).
FILLER_WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her",
    "are", "were", "this", "which", "be", "or", "an", "had", "not", "but", "have", "it", "they", "one", "all", "their",
    "been", "has", "more", "when", "who", "will", "no", "if", "out", "so", "said", "what", "up", "its", "about",
    "into", "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may", "then",
    "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after",
    "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well",
    "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very",
    "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off",
    "come", "since", "against", "go", "came", "right", "used", "take", "three",
]


def tokens_for_words(num_words: int) -> int:
    """Tokens the twin counts for `num_words` words: round(words * 1.3), at least 1."""
    return max(1, (13 * num_words + 5) // 10)


def words_for_tokens(num_tokens: int) -> int:
    """Fewest words whose token count reaches `num_tokens` (at most one token over)."""
    if num_tokens <= 1:
        return 1
    words = max(1, -(-(10 * num_tokens - 5) // 13))
    while tokens_for_words(words) < num_tokens:
        words += 1
    return words


def count_text_tokens(text: str) -> int:
    """The twin's token count for a text prompt."""
    return tokens_for_words(len(text.split()))


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """A prompt of filler words that the twin counts as `num_tokens` tokens (+0/+1)."""
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(words_for_tokens(num_tokens)))


def filler_token_text(index: int, seed: int = 0) -> str:
    """Deterministic text of the `index`-th generated token (a leading space, like BPE pieces)."""
    return " " + FILLER_WORDS[(index * 7 + seed * 13) % len(FILLER_WORDS)]


class Prompts:
    """Text prompts of a requested token count, sized by the engine's own tokenizer when it is known.

    `word_tokens` is what each filler word costs the engine (from its /tokenize); without it the twin's
    rule applies. Text, not token ids: the engine's front end tokenizes it, as it does production's.
    """

    def __init__(self, word_tokens: Mapping[str, int] | None = None, first_word_tokens: int | None = None) -> None:
        costs = {w: c for w, c in (word_tokens or {}).items()
                 if isinstance(c, int) and not isinstance(c, bool) and c >= 1 and w in FILLER_WORDS}
        # Sized exactly only with every word measured and some one-token word to end a prompt on.
        self.word_tokens: dict[str, int] = costs if len(costs) == len(FILLER_WORDS) and 1 in costs.values() else {}
        self._by_cost = sorted(self.word_tokens, key=lambda w: (self.word_tokens[w], w))
        # A prompt starts with FILLER_WORDS[0], whose cost at a text's start may differ from inside one.
        self._first = first_word_tokens if isinstance(first_word_tokens, int) and first_word_tokens >= 1 else None

    @property
    def exact(self) -> bool:
        return bool(self.word_tokens)

    def make(self, num_tokens: int, rng: random.Random) -> str:
        if not self.word_tokens:
            return make_prompt(num_tokens, rng)
        words: list[str] = []
        left = max(1, num_tokens)
        if self._first is not None and self._first <= left:
            words, left = [FILLER_WORDS[0]], left - self._first
        while left > 0:
            # A seeded draw among the words that still fit: the sum lands on the requested count.
            fitting = [w for w in self._by_cost if self.word_tokens[w] <= left]
            word = rng.choice(fitting)
            words.append(word)
            left -= self.word_tokens[word]
        return " ".join(words)
