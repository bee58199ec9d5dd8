"""Small tokenizers for tiny checkpoints, built offline and bit-identical on every run.

Each tokenizer is the transformers class a real checkpoint names (`CLIPTokenizer`, `T5Tokenizer`
a.k.a. `T5TokenizerFast`, `GemmaTokenizer` a.k.a. `GemmaTokenizerFast`), so its normalizer,
pre-tokenizer and post-processor come from the class code exactly as they do when a user's
checkpoint is loaded; only the vocabulary is small. The `tokenizers` library runs the class's own
normalizer / pre-tokenizer over a fixed corpus, and the merges are counted here with a greedy
byte-pair learner whose ties break by the pair's text: the library's trainers break ties in
hash-map order, so their merges and scores change from one process to the next.

Vocabulary layouts follow the real tokenizers:
- CLIP: the 256 byte symbols in GPT-2 order ("!" is id 0), the same with "</w>", merges, then
  `<|startoftext|>`, `<|endoftext|>` last (CLIP pools at `input_ids.argmax()`, so EOS must be the
  largest id).
- T5 / UMT5: `<pad>`=0, `</s>`=1, `<unk>`=2, Unigram pieces, then `<extra_id_N>` in reverse order.
- Gemma: `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, `<mask>`=4, the 256 `<0xNN>` byte-fallback
  tokens, BPE pieces, then the chat / image tokens.
"""
from __future__ import annotations

import heapq
import math
import re
from collections import Counter

_SUBJECTS = """
dog cat horse bird fox owl rabbit tiger lion bear wolf deer duck goose swan eagle parrot
penguin dolphin whale shark turtle frog snake lizard butterfly bee spider monkey robot knight
wizard astronaut dancer farmer sailor painter chef child woman man girl boy king queen dragon
unicorn castle tower bridge house cabin temple lighthouse windmill train car bicycle boat ship
airplane balloon rocket lantern candle clock teapot guitar piano violin drum trumpet flute
bell book chair table lamp window door mirror umbrella basket bottle cup bowl apple banana
cherry lemon orange pear grape strawberry pumpkin carrot tomato mushroom flower rose tulip
sunflower tree forest mountain river lake ocean beach island desert valley meadow garden
field village city street market harbor station kitchen library museum studio cave volcano
glacier waterfall canyon rainbow cloud storm snow rain sunset sunrise moon star planet galaxy
""".split()

_ATTRIBUTES = """
red orange yellow green blue purple pink brown black white gray golden silver bronze tiny
small large huge tall short round square triangular wooden metal glass stone paper plastic
woolen velvet shiny matte glowing dark bright pale vivid colorful ancient modern futuristic
rusty broken cozy quiet noisy happy sad sleepy angry calm curious brave gentle fierce
elegant clumsy fluffy smooth rough striped spotted transparent frozen burning floating
flying running jumping dancing singing swimming sleeping reading painting cooking laughing
""".split()

_SCENES = """
in the morning at night under the stars on a table near the window beside a river in a snowy
forest on a sandy beach in a busy street inside a glass jar on top of a hill in front of a
castle behind the house during a storm at sunset in the rain with soft light with dramatic
lighting in watercolor style as an oil painting as a pencil sketch in pixel art style as a
photograph with shallow depth of field from above from the side close up wide angle view
""".split(" with ")

_SOUNDS = """
the sound of waves a dog barking loudly a bell ringing a drum beat with a low tone a high
pitched whistle rain falling on a roof a piano playing a chord people talking in a room a bird
singing an engine running thunder rolling in the distance footsteps on gravel wind through
the trees a crowd cheering a cat purring glass breaking a violin melody a train passing by
""".split(" a ")

_EXTRA = """
a robot dancing dance monkey a photo of a cat a painting of a dog negative worst quality low
quality blurry distorted jpeg artifacts ugly deformed watermark text signature overexposed
hello world the quick brown fox jumps over the lazy dog one two three four five six seven
eight nine ten 2024 100 3d 4k hd 8k
""".split("\n")

_CORPUS_SIZE = 2000


def corpus() -> list[str]:
    """The fixed training corpus: every subject x attribute pairing once, in a fixed order."""
    lines = []
    scenes = [s.strip() for s in _SCENES if s.strip()]
    for i in range(_CORPUS_SIZE):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        attribute = _ATTRIBUTES[(i * 7) % len(_ATTRIBUTES)]
        scene = scenes[(i * 11) % len(scenes)]
        lines.append(f"a {attribute} {subject} {scene}")
    lines += [s for s in _SOUNDS + _EXTRA]
    lines += [f"{a} {s}" for a in _ATTRIBUTES for s in _SUBJECTS[:24]]
    return sorted({" ".join(line.split()) for line in lines} - {""})


def learn_merges(units: Counter, num_tokens: int, end_of_word: str = "") -> list[tuple[str, str]]:
    """Greedy byte-pair merges over word units (unit -> count) until they have made `num_tokens`
    distinct new tokens (two merges may make the same string); ties go to the smaller pair.

    Raises if the corpus runs out of pairs first (the vocabulary size is a contract with the text
    encoder's embedding table, so it is never silently smaller)."""
    words, weights = [], []
    for unit, count in sorted(units.items()):
        symbols = list(unit)
        if end_of_word:
            symbols[-1] += end_of_word
        words.append(symbols)
        weights.append(count)
    pair_counts: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for w, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += weights[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    made: set[str] = set()
    while len(made) < num_tokens:
        while heap and -heap[0][0] != pair_counts.get(heap[0][1], 0):
            heapq.heappop(heap)                        # stale entry: the count has changed
        if not heap or heap[0][0] == 0:
            raise ValueError(f"corpus supports only {len(made)} new tokens, {num_tokens} asked")
        _, best = heapq.heappop(heap)
        merges.append(best)
        made.add(best[0] + best[1])
        touched: set[tuple[str, str]] = set()
        for w in sorted(where.pop(best, ())):
            symbols, weight = words[w], weights[w]
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] -= weight
                touched.add(pair)
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            words[w] = out
            for pair in zip(out, out[1:]):
                pair_counts[pair] += weight
                where.setdefault(pair, set()).add(w)
                touched.add(pair)
        pair_counts.pop(best, None)
        for pair in touched - {best}:
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
            else:
                del pair_counts[pair]
    return merges


def _new_tokens(merges: list[tuple[str, str]]) -> list[str]:
    """The distinct strings the merges make, in the order they were first made."""
    return list(dict.fromkeys(a + b for a, b in merges))


def _units(backend, lines: list[str]) -> Counter:
    """Word units as the tokenizer's own normalizer + pre-tokenizer produce them."""
    units: Counter = Counter()
    for line in lines:
        text = backend.normalizer.normalize_str(line) if backend.normalizer else line
        for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text):
            units[piece] += 1
    return units


def _byte_symbols() -> list[str]:
    """GPT-2 / CLIP byte-to-unicode table, in its id order (printable bytes first)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


_BASE_CHARS = [chr(c) for c in range(33, 127)]   # printable ASCII: no <unk> for plain prompts


def clip_tokenizer(vocab_size: int = 1000, pad_token: str = "<|endoftext|>",
                   model_max_length: int = 77):
    """CLIPTokenizer (SD3 / FLUX CLIP-L; SD3's CLIP-G with pad_token="!")."""
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    base = symbols + [s + "</w>" for s in symbols]
    num_merges = vocab_size - len(base) - 2
    units = _units(CLIPTokenizer().backend_tokenizer, corpus())
    merges = learn_merges(units, num_merges, end_of_word="</w>")
    tokens = base + _new_tokens(merges) + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != vocab_size:
        raise ValueError(f"CLIP vocabulary has duplicate merges: {len(vocab)} != {vocab_size}")
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token,
                         model_max_length=model_max_length)


def t5_tokenizer(vocab_size: int = 1000, extra_ids: int = 100, model_max_length: int = 512):
    """T5Tokenizer (= T5TokenizerFast in transformers 5): Unigram pieces with log-frequency scores
    taken from the greedy segmentation of the corpus, rounded so that they are exact."""
    from transformers import T5Tokenizer

    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    base = ["\u2581"] + _BASE_CHARS
    num_pieces = vocab_size - len(specials) - extra_ids
    units = _units(T5Tokenizer().backend_tokenizer, corpus())
    merges = learn_merges(units, num_pieces - len(base))
    pieces = base + _new_tokens(merges)
    counts = _segment_counts(units, merges)
    total = sum(counts.values()) + len(pieces)
    scores = [(p, round(math.log((counts.get(p, 0) + 1) / total), 4)) for p in pieces]
    extras = [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    vocab = specials + scores + extras
    if len({p for p, _ in vocab}) != vocab_size:
        raise ValueError(f"T5 vocabulary has duplicates: {len(vocab)} != {vocab_size}")
    return T5Tokenizer(vocab=vocab, extra_ids=extra_ids, model_max_length=model_max_length)


def _segment_counts(units: Counter, merges: list[tuple[str, str]]) -> Counter:
    """How often each piece appears when the corpus is segmented with `merges` (BPE order)."""
    rank = {pair: i for i, pair in enumerate(merges)}
    counts: Counter = Counter()
    for unit, count in units.items():
        symbols = list(unit)
        while len(symbols) > 1:
            pairs = [(rank.get(p, math.inf), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
            best, i = min(pairs)
            if best == math.inf:
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            counts[s] += count
    return counts


GEMMA_TRAILING = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]


def gemma_tokenizer(vocab_size: int = 1000):
    """GemmaTokenizer (= GemmaTokenizerFast): BPE with byte fallback, no dummy prefix; word units
    start at each "\u2581" as SentencePiece splits them."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    base = ["\u2581"] + _BASE_CHARS
    num_merges = vocab_size - len(specials) - len(byte_tokens) - len(base) - len(GEMMA_TRAILING)
    units: Counter = Counter()
    for line in corpus():
        for unit in re.split("(?=\u2581)", line.replace(" ", "\u2581")):
            if unit:
                units[unit] += 1
    merges = learn_merges(units, num_merges)
    tokens = specials + byte_tokens + base + _new_tokens(merges) + GEMMA_TRAILING
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != vocab_size:
        raise ValueError(f"Gemma vocabulary has duplicates: {len(vocab)} != {vocab_size}")
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_TRAILING})
    return tokenizer
