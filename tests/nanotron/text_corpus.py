"""A small text corpus in JSON lines and a word-level tokenizer trained on it, made locally
(no network): what the real-data tests feed nanotron's data path.

Every word of the corpus is one token (a WordLevel model over whitespace-separated words,
`tokenizers`, saved as a `transformers.PreTrainedTokenizerFast` folder), so a corpus of
`tokens` words gives exactly `tokens` token ids, and nanotron's `clm_process` cuts them into
a known number of samples (`samples_from`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = tuple(f"w{i}" for i in range(40))
SPECIAL = ("[UNK]", "</s>")


def write_corpus(folder: Path, tokens: int, *, words_per_line: int = 10, seed: int = 0,
                 column: str = "text") -> Path:
    """`folder/part-0.jsonl` and `part-1.jsonl`: lines of `{column: "w3 w17 ..."}`,
    `tokens` words in all, drawn from `WORDS` by a seeded generator. Returns the folder."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lines, left = [], tokens
    while left:
        n = min(words_per_line, left)
        lines.append(json.dumps({column: " ".join(rng.choice(WORDS) for _ in range(n))}))
        left -= n
    half = len(lines) // 2
    (folder / "part-0.jsonl").write_text("\n".join(lines[:half]) + "\n")
    (folder / "part-1.jsonl").write_text("\n".join(lines[half:]) + "\n")
    return folder


def write_tokenizer(folder: Path, words=WORDS) -> Path:
    """A word-level tokenizer over `words` (plus [UNK] and the eos </s>), trained with
    `tokenizers` and saved by `PreTrainedTokenizerFast.save_pretrained`. Returns the folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.train_from_iterator([" ".join(words)], WordLevelTrainer(special_tokens=list(SPECIAL)))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    return folder


def samples_from(tokens: int, seq: int) -> int:
    """The samples nanotron 0.4's `clm_process` cuts from `tokens` token ids (one map
    batch) at sequence length `seq`: chunks of seq + 1 overlapping by one token, starting
    every seq tokens, the last (and any remainder) dropped."""
    total = ((tokens - 1) // seq) * seq + 1 if tokens >= seq + 1 else tokens
    return len(range(0, total - (seq + 1), seq))
