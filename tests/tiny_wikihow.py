"""Write a WikiHow-format data folder and a tiny T5 model directory, offline.

    python tests/tiny_wikihow.py data tiny-t5
    python t5_fsdp_finetune.py ... --data-dir data --model-name tiny-t5   (see README)

data/wikihowAll.csv has the real file's columns (headline, title, text) and quirks (headlines
are "\\nStep one.,\\nStep two." lists, paragraphs are joined by "\\n,", quotes and commas inside
fields) for a few hundred templated how-to articles, plus rows the WikiHow filters must drop.
With split_files=True the official split lists all_train.txt / all_val.txt / all_test.txt go
beside it, holding titles the way the dataset's process.py writes them (alphanumerics only).

tiny-t5/ is a T5ForConditionalGeneration with a small T5Config and a T5Tokenizer whose
sentencepiece vocabulary is trained on the fixture text, both written with save_pretrained.
transformers 5 builds T5Tokenizer from a vocab=[(piece, score), ...] list, which needs no
protobuf (loading a bare spiece.model would).
"""
import argparse
import csv
import io
import random
from pathlib import Path

VERBS = ["Clean", "Paint", "Repair", "Build", "Decorate", "Organize", "Measure", "Polish", "Wrap",
         "Move", "Sand", "Fold", "Store", "Dry", "Photograph", "Sell", "Inspect", "Label",
         "Protect", "Replace"]
THINGS = ["a Bicycle", "a Garden Bench", "a Kitchen Table", "a Wooden Fence", "a Bookshelf",
          "a Canoe", "a Window Frame", "a Leather Sofa", "a Clay Pot", "a Birdhouse", "a Guitar",
          "a Tent", "a Lamp", "a Doghouse", "a Mailbox", "a Picnic Basket", "a Treehouse",
          "a Rocking Chair", "a Skateboard",
          "Your Cat's Bed"]  # the split lists spell it YourCatsBed: alphanumerics only
TOOLS = ["a soft brush", "a damp cloth", "fine sandpaper", "a tape measure", "a screwdriver",
         "warm water", "a bucket", "some gloves", "a pencil", "a level", "a sponge", "a ladder"]
WAYS = ["slowly", "carefully", "twice", "from top to bottom", "in small sections", "before noon"]
REASONS = ["so that nothing gets scratched", "because dust hides small cracks",
           "which saves time later", "so the work lasts for years",
           "since rushing leads to mistakes", "and ask a friend to help"]
TRAIN, VAL, TEST = 300, 64, 36  # articles per split; 400 = every verb with every thing
# Rows the filters must drop (empty text or headline, headline not shorter than 0.75 x text),
# each under a title that the split lists name, so that only the filter can drop them.
DROPPED = {
    "How to Keep an Empty Article": ("\nThis headline has no article.", ""),
    "How to Write No Summary": ("", "This article has no summary at all. "
                                    "It is long enough to be kept otherwise."),
    "How to Summarize at Length": ("\nA summary that goes on and on, "
                                   "far longer than the tiny article it summarizes.",
                                   "Too short."),
}
TEXT_COLUMNS = ("headline", "title", "text")


def article(rng, verb, thing):
    """A title, a WikiHow-style headline (summary) and text for one how-to article."""
    noun = thing.split(" ", 1)[1].lower()
    steps = [f"{rng.choice(['Use', 'Take', 'Get'])} {rng.choice(TOOLS)}",
             f"{verb} the {noun} {rng.choice(WAYS)}",
             f"Check it {rng.choice(['again', 'in daylight', 'the next day'])}"
             ][: rng.choice([1, 2, 3])]
    paragraphs = [f"{step}. Do this {rng.choice(WAYS)}, {rng.choice(REASONS)}." for step in steps]
    if rng.random() < 0.2:  # the quirks clean_text removes
        paragraphs[0] = f'Example of text: ``{paragraphs[0]}" she said.'
    return f"How to {verb} {thing}", "\n" + ".,\n".join(steps) + ".", "\n,".join(paragraphs)


def articles():
    """Every (title, headline, text) of the fixture, in file order (shuffled with a fixed seed)."""
    rng = random.Random(0)
    pairs = [(verb, thing) for verb in VERBS for thing in THINGS]
    rng.shuffle(pairs)
    rows = [article(rng, verb, thing) for verb, thing in pairs]
    for i, (title, (headline, text)) in enumerate(DROPPED.items()):
        rows.insert(10 + 50 * i, (title, headline, text))
    return rows


def normalized(title):
    """A title as the WikiHow dataset's process.py writes it into the split lists."""
    return "".join(c for c in title if c.isalnum())


def split_titles():
    """{split: titles}: the first TRAIN kept articles train, then VAL validation, then TEST test."""
    kept = [title for title, _, _ in articles() if title not in DROPPED]
    splits = {"train": kept[:TRAIN], "val": kept[TRAIN:TRAIN + VAL], "test": kept[TRAIN + VAL:]}
    splits["train"] += list(DROPPED)
    return splits


def write_wikihow(root, split_files=True):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "wikihowAll.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(TEXT_COLUMNS)
        writer.writerows((headline, title, text) for title, headline, text in articles())
    if split_files:
        for split, titles in split_titles().items():
            (root / f"all_{split}.txt").write_text("".join(normalized(t) + "\n" for t in titles))
    return root


def write_csv_without_headline(root):
    """A --data-dir whose wikihowAll.csv lacks the headline column."""
    folder = Path(root) / "no_headline"
    folder.mkdir(parents=True)
    (folder / "wikihowAll.csv").write_text("title,text\nHow to Sit,Sit down on a chair.\n")
    return folder


def train_vocab(lines, vocab_size):
    """A sentencepiece unigram vocabulary as [(piece, score)], with T5's ids: <pad> 0, </s> 1,
    <unk> 2."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=vocab_size, model_type="unigram",
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
                                   minloglevel=2)
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return [(processor.id_to_piece(i), processor.get_score(i))
            for i in range(processor.get_piece_size())]


def write_tiny_t5(path, vocab_size=320, seed=0, d_model=32, num_layers=2, untied=False,
                  **config):
    """save_pretrained a small random T5 and its tokenizer into path; return path. (The defaults:
    200 KB of weights, lm_head tied to the embedding as in t5-small; d_model 1024 and 4 layers:
    322 MB, enough to show in a process's memory.) untied: an lm_head of its own, as T5 v1.1 and
    flan-t5 have; config: other T5Config values (d_kv, d_ff, num_heads and the relative attention
    buckets included)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, in a log

    lines = [line for title, headline, text in articles()
             for line in (title, *headline.split("\n"), text) if line]
    tokenizer = T5Tokenizer(vocab=train_vocab(lines, vocab_size), extra_ids=0)
    # The shape's defaults sit in the dict so that config can override them (t5-base's shape:
    # benchmarks/run.py --only lora); passed as keywords they would be given twice.
    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, num_layers=num_layers,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id,
                      **{"d_kv": d_model // 2, "d_ff": 2 * d_model, "num_heads": 2,
                         "relative_attention_num_buckets": 8,
                         "relative_attention_max_distance": 32, "dropout_rate": 0.1, **config})
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    if untied:
        # transformers 5 ties T5's lm_head always (T5Config forces tie_word_embeddings, whose
        # False only turns off v1.1's output scaling), unless a checkpoint holds two different
        # tensors: as flan-t5's does.
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) / d_model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a WikiHow-format data folder and a tiny T5 "
                                     "model directory, offline (see the README).")
    parser.add_argument("data_dir", help="folder for wikihowAll.csv and the split lists "
                        "(t5_fsdp_finetune.py --data-dir)")
    parser.add_argument("model_dir", help="folder for the tiny T5 and its tokenizer "
                        "(t5_fsdp_finetune.py --model-name)")
    args = parser.parse_args()
    data, model = write_wikihow(args.data_dir), write_tiny_t5(args.model_dir)
    print(f"wrote {data / 'wikihowAll.csv'} (+ split lists) "
          f"and the tiny T5 model and tokenizer in {model}")
