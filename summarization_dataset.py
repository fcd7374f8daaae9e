"""The WikiHow summarization dataset for t5_fsdp_finetune.py, read from a local wikihowAll.csv.

    dataset = wikihow(tokenizer, "train", 1500, 512, 150, data_dir="data")
    dataset[0]  # {"source_ids", "source_mask", "target_ids", "target_mask"}

wikihowAll.csv (columns headline, title, text) is read with the `datasets` CSV loader. The
official split lists all_train.txt / all_val.txt / all_test.txt are used when they sit beside it;
without them a title's hash decides its split (about 90/5/5, the same on every machine). Rows
are filtered and cleaned as the original `wikihow` dataset loader did, then with clean_text.
Targets are padded with -100, the label that the loss ignores; target_mask marks real tokens.
"""
import csv
import hashlib
import os
import re

import datasets
from torch.utils.data import Dataset

COLUMNS = ("headline", "title", "text")
SPLIT_FILES = {"train": "all_train.txt", "validation": "all_val.txt", "test": "all_test.txt"}
DOWNLOAD_HELP = ("download wikihowAll.csv from "
                 "https://ucsb.box.com/s/ap23l8gafpezf4tq3wapr6u8241zz358 (linked from "
                 "https://github.com/mahnazkoupaee/WikiHow-Dataset) into that folder, or pass "
                 "--data-dir; README.md, 'Data', has the commands")


class WikiHowError(ValueError):
    """The data cannot be used; the message says why and how to fix it, in one line."""


def normalize_title(title):
    """A title as the WikiHow dataset's process.py wrote it into the split lists: alphanumerics."""
    return "".join(c for c in title if c.isalnum())


def fallback_split(title):
    """train, validation or test for a title, by a stable hash: 90/5/5%, disjoint, reproducible."""
    bucket = int(hashlib.md5(normalize_title(title).encode("utf-8")).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def filter_and_clean(headline, text):
    """The original loader's filter and fixes: None if the row is dropped, else (headline, text)."""
    headline, text = (headline or "").strip(), (text or "").strip()
    # Drops rows without a summary or article, and short articles with long summaries.
    if not headline or not text or len(headline) >= 0.75 * len(text):
        return None
    return headline.replace(".,", "."), re.sub(r"[.]+[\n]+[,]", ".\n", text)


def clean_text(text):
    """The tutorial's clean_text, except that line breaks become spaces instead of gluing words."""
    for junk in ("Example of text:", "Example of Summary:", "``", '"'):
        text = text.replace(junk, "")
    return " ".join(text.split())


def check_csv(data_dir):
    """Raise a WikiHowError unless data_dir's wikihowAll.csv exists, has the columns and at least
    one article: read from its first lines, so that a wrong file is refused at once. Returns its
    path."""
    path = os.path.join(data_dir, "wikihowAll.csv")
    if not os.path.isfile(path):
        raise WikiHowError(f"{path} not found: {DOWNLOAD_HELP}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = csv.reader(f)
            header, first_row = next(rows, []), next(rows, None)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise WikiHowError(f"cannot read {path} ({e}); download it again") from None
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise WikiHowError(f"{path} lacks the column(s) {', '.join(missing)} (its header is "
                           f"{','.join(header)!r}); wikihowAll.csv needs {', '.join(COLUMNS)}: "
                           f"{DOWNLOAD_HELP}")
    if first_row is None:
        raise WikiHowError(f"{path} has its header but no article: {DOWNLOAD_HELP}")
    return path


def read_articles(data_dir, split, num_samples=None):
    """The first num_samples (all if None) cleaned (title, text, headline) rows of a split."""
    path = check_csv(data_dir)
    present = [name for name in SPLIT_FILES.values()
               if os.path.isfile(os.path.join(data_dir, name))]
    if present and len(present) < len(SPLIT_FILES):
        raise WikiHowError(f"{data_dir} has {', '.join(present)} but not all of "
                           f"{', '.join(SPLIT_FILES.values())}: add the missing split lists, or "
                           "remove them all to split by title hash")
    titles = None
    if present:
        with open(os.path.join(data_dir, SPLIT_FILES[split]), encoding="utf-8") as f:
            titles = {normalize_title(line) for line in f if line.strip()}

    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    # Quiet: it would log a parse error that the one raised below repeats.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        # na_filter=False: an empty field stays "" instead of becoming NaN.
        features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
        table = datasets.load_dataset("csv", data_files=path, split="train", usecols=list(COLUMNS),
                                      na_filter=False, features=features)
    except Exception as e:
        reason = " ".join(str(e.__cause__ or e).split())
        raise WikiHowError(
            f"cannot parse {path} as CSV ({reason[:300]}); download it again") from None
    finally:
        datasets.logging.set_verbosity(verbosity)

    articles = []
    for batch in table.iter(batch_size=1000):
        for headline, title, text in zip(*(batch[c] for c in COLUMNS)):
            title = (title or "").strip()
            if titles is not None:
                in_split = normalize_title(title) in titles
            else:
                in_split = fallback_split(title) == split
            cleaned = filter_and_clean(headline, text) if in_split else None
            if cleaned:
                articles.append((title, clean_text(cleaned[1]), clean_text(cleaned[0])))
                if num_samples and len(articles) == num_samples:
                    return articles
    return articles


class wikihow(Dataset):
    """WikiHow articles (source) and their headlines (target), tokenized once, padded."""

    def __init__(self, tokenizer, type_path, num_samples, input_length, output_length,
                 print_text=False, data_dir="data"):
        split = {"val": "validation"}.get(type_path, type_path)
        if split not in SPLIT_FILES:
            raise WikiHowError(f"unknown split {type_path!r}: use train, validation (val) or test")
        self.articles = read_articles(data_dir, split, num_samples)
        if not self.articles:
            raise WikiHowError(f"the {split} split of {os.path.join(data_dir, 'wikihowAll.csv')} "
                               "has no usable articles; check it and the split lists beside it")
        self.print_text = print_text
        source = tokenizer([text for _, text, _ in self.articles], max_length=input_length,
                           padding="max_length", truncation=True, return_tensors="pt")
        target = tokenizer([headline for _, _, headline in self.articles], max_length=output_length,
                           padding="max_length", truncation=True, return_tensors="pt")
        self.source_ids, self.source_mask = source["input_ids"], source["attention_mask"]
        self.target_mask = target["attention_mask"]
        # -100 on padding: the label that cross-entropy (and T5's own loss) ignores.
        self.target_ids = target["input_ids"].masked_fill(self.target_mask == 0, -100)

    def __len__(self):
        return len(self.articles)

    def references(self, tokenizer):
        """The target summaries as the model learns them (cut to output_length), as text: what
        ROUGE compares the generated ones with (as run_summarization.py decodes its labels)."""
        ids = self.target_ids.masked_fill(self.target_ids == -100, tokenizer.pad_token_id)
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    def __getitem__(self, index):
        if self.print_text:
            print("Input Text: ", self.articles[index][1])
        return {"source_ids": self.source_ids[index], "source_mask": self.source_mask[index],
                "target_ids": self.target_ids[index], "target_mask": self.target_mask[index]}



# ROUGE, the task's metric: the scores Hugging Face's run_summarization.py reports.
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
ROUGE_INSTALL = "pip install rouge_score==0.1.2"  # requirements.txt pins it


def sentence_lines(text):
    """text stripped, one sentence per line: ROUGE-Lsum scores the longest common subsequence
    sentence by sentence, split at line breaks. run_summarization.py splits sentences with
    nltk.sent_tokenize, whose punkt model is a separate download (nltk.download("punkt_tab"), not
    possible offline); this split after '.', '!' or '?' and a space gives the same lines for
    WikiHow's headlines, which are lists of short steps. (Abbreviations such as "e.g. " would be
    split where punkt would not.)"""
    return "\n".join(re.split(r"(?<=[.!?])\s+", text.strip()))


def rouge_scores(predictions, references):
    """ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum of predictions against references (lists of
    texts, pair by pair), as run_summarization.py computes them: the rouge_score package's F-measure
    with Porter stemming, on texts split into sentences (sentence_lines), averaged over the pairs
    and given in percent. (Its `evaluate` metric reports the middle of bootstrap resamples of that
    mean: close to it, but random.)"""
    from rouge_score import rouge_scorer  # optional: needed only here (ROUGE_INSTALL)

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score(sentence_lines(reference), sentence_lines(prediction))
        for key in ROUGE_KEYS:
            totals[key] += scores[key].fmeasure
    return {key: round(100 * total / max(len(predictions), 1), 4) for key, total in totals.items()}
