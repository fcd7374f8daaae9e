"""Write a WikiHow-format data folder whose lengths follow WikiHow's published statistics.

    python benchmarks/wikihow_lengths.py DIR [--articles N] [--seed S] [--tokens-per-word X]

The tests' fixture (tests/tiny_wikihow.py) has articles of one to three sentences; the real
WikiHow's are long and their lengths vary widely, which is what batching by tokens
(t5_fsdp_finetune.py --max-tokens) is for. Koupaee and Wang, "WikiHow: A Large Scale Text
Summarization Dataset" (2018), Table 1: 230,843 articles of 579.8 words on average, summaries of
62.1 words. Here each article's and each summary's length is drawn from a log-normal
distribution with that mean (sigma 0.75 for articles, 0.6 for summaries: long tails, a few
articles of several thousand words) and written in the fixture's sentences, so that the tests'
tiny tokenizer knows them. What the script sees is tokens: t5-base's sentencepiece makes about
1.3 tokens of an English word (our estimate), the tests' tokenizer 2.5 of these words (measured),
so each length is scaled by 1.3 / --tokens-per-word, and the tokenized articles average about
754 tokens, their summaries 81. The folder has no split lists: the script splits by title.
"""
import argparse
import csv
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_wikihow import REASONS, THINGS, TOOLS, VERBS, WAYS  # noqa: E402

ARTICLE_WORDS, SUMMARY_WORDS = 579.8, 62.1  # Koupaee and Wang (2018), Table 1
ARTICLE_SIGMA, SUMMARY_SIGMA = 0.75, 0.6
T5_TOKENS_PER_WORD = 1.3  # t5-base's tokenizer on English text (an estimate)


def words(rng, mean, sigma):
    """A log-normal count of words with this mean (mu = ln(mean) - sigma^2 / 2), at least 3."""
    return max(3, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def sentences(rng, verb, noun, count):
    """Sentences of the fixture's kind, count words in all (the last one cut to fit)."""
    text = []
    while len(text) < count:
        text += (f"{rng.choice(['Use', 'Take', 'Get'])} {rng.choice(TOOLS)} to {verb.lower()} "
                 f"the {noun} {rng.choice(WAYS)}, {rng.choice(REASONS)}.").split()
    return " ".join(text[:count]).rstrip(",") + "."


def write(root, articles, seed, tokens_per_word):
    rng, scale = random.Random(seed), T5_TOKENS_PER_WORD / tokens_per_word
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "wikihowAll.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("headline", "title", "text"))
        for i in range(articles):
            verb, thing = rng.choice(VERBS), rng.choice(THINGS)
            noun = thing.split(" ", 1)[1].lower()
            text = sentences(rng, verb, noun, words(rng, ARTICLE_WORDS * scale, ARTICLE_SIGMA))
            headline = sentences(rng, verb, noun, words(rng, SUMMARY_WORDS * scale, SUMMARY_SIGMA))
            writer.writerow((f"\n{headline}", f"How to {verb} {thing} ({i})", text))
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="the data folder to write (wikihowAll.csv)")
    parser.add_argument("--articles", type=int, default=2000, help="number of articles")
    parser.add_argument("--seed", type=int, default=0, help="the lengths' and words' seed")
    parser.add_argument("--tokens-per-word", type=float, default=2.5, help="of the tokenizer the "
                        "data is for (2.5: the tests' tiny one; 1.3: t5-base's)")
    options = parser.parse_args()
    write(options.dir, options.articles, options.seed, options.tokens_per_word)
