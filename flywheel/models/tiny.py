"""The tiny test model: a small random Qwen2 with a locally trained byte-level BPE tokenizer.

`build_tiny(seed)` returns a cached Hugging Face model directory (config, safetensors weights,
tokenizer, ChatML chat template) that loads with `AutoModelForCausalLM`/`AutoTokenizer` like any
real checkpoint, builds in about a second and is byte-for-byte reproducible. The tokenizer is
trained on a synthetic corpus generated here from a fixed seed, so it does not depend on `seed`:
every tiny model shares one vocabulary; `seed` only changes the initial weights.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from flywheel.models.cache import cached_build

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

VOCAB_SIZE = 2048
CORPUS_SEED = 1234
CORPUS_LINES = 12_000

MODEL_PARAMS = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 384,
    # Room for what agent CLIs send on their first turn (Claude Code 2.1: 39 K tokens in this
    # tokenizer); RoPE has no learned positions, so the weights do not depend on it.
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
}

# Qwen2's pre-tokenizer split: words with their leading space, single digits, punctuation runs.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. Every tag strips the whitespace before it, so only the quoted strings are output.
CHAT_TEMPLATE = """
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system %}
        {{- system + '\n\n' }}
    {%- endif %}
    {{- '# Tools\nYou may call these tools:\n<tools>\n' }}
    {%- for tool in tools %}
        {{- (tool | tojson) + '\n' }}
    {%- endfor %}
    {{- '</tools>\nTo call one, reply with <tool_call>{"name": <name>, "arguments": <args>}</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- elif system %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') }}
    {%- for call in message.tool_calls or [] %}
        {%- set fn = call.function if call.function is defined else call %}
        {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
        {{- '\n' if message.content or not loop.first else '' }}
        {{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' + args + '}</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

WORDS = """
the a an and or but if then so because when while after before of to in on at by for with from
about into over under between through during without is are was were be been being have has had do
does did will would can could should may might must shall not no yes all any some many much more
most few each every other another such only own same than too very just also again still even
I you he she it we they me him her us them my your his its our their this that these those what
which who whom whose where why how there here now today tomorrow yesterday always never often
sometimes number numbers sum total answer question result equal equals plus minus times divided
add subtract multiply divide count half double twice first second third last next one two three four
five six seven eight nine ten hundred thousand apple apples orange oranges book books cat cats dog
dogs bird birds tree trees car cars house houses city cities river rivers boy girl man woman child
children friend friends teacher student students school class day days week weeks month year years
hour hours minute minutes time money dollar dollars cent cents price cost box boxes bag bags cup
cups water food bread milk coffee tea table chair door window room road street shop store market
farm garden game games team player players ball score point points page pages word words letter
letters story stories problem problems work job people person family mother father sister brother
go goes went gone come comes came get gets got make makes made take takes took give gives gave see
sees saw know knows knew think thinks thought say says said tell tells told find finds found use
uses used want wants wanted need needs needed buy buys bought sell sells sold pay pays paid eat eats
ate read reads write writes wrote run runs ran walk walks walked help helps helped start starts
started stop stops stopped keep keeps kept put puts let lets call calls called ask asks asked try
tries tried leave leaves left bring brings brought carry carries share shares shared split splits
good bad big small large little long short high low old new young great right wrong true false
best better worse worst easy hard simple fast slow early late open close full empty red blue green
yellow white black happy sad hot cold each both either neither please thanks thank hello sure okay
user assistant system tool tools function name arguments value result calculator search weather
compute check step steps solve solution explain because therefore finally let's here's
animal animals flower flowers mountain mountains ocean sea island forest field fields sky sun moon
star stars rain snow wind cloud clouds morning evening night afternoon summer winter spring autumn
kitchen bedroom office library hospital station airport train trains bus buses plane ship ships
bicycle bike ticket tickets letter paper pencil pen pens computer phone phones picture pictures song
songs music movie movies party parties dinner lunch breakfast cake cakes cookie cookies candy egg eggs
chicken fish rice soup sandwich pizza banana bananas grape grapes lemon cherry potato potatoes carrot
carrots tomato shirt shirts shoe shoes hat hats coat dress jacket sock socks toy toys doll robot
number line lines row rows group groups pair pairs piece pieces part parts side sides corner center
inch inches foot feet meter meters mile miles kilogram pound pounds liter gallon degree degrees
percent fraction answer answers reason reasons idea ideas example examples fact facts rule rules
think thinking learn learns learned learning teach teaches taught play plays played playing plan
plans planned build builds built grow grows grew grown fill fills filled cut cuts drive drives drove
fly flies flew swim swims swam sing sings sang draw draws drew paint paints painted cook cooks cooked
clean cleans cleaned wash washes washed open opens opened close closes closed move moves moved turn
turns turned hold holds held win wins won lose loses lost spend spends spent save saves saved collect
collects collected remain remains remaining receive receives received finish finishes finished
measure measures measured order orders ordered deliver delivers delivered return returns returned
visit visits visited travel travels traveled arrive arrives arrived begin begins began wait waits
waited watch watches watched listen listens listened answer answered explain explains explained
quick quickly slowly carefully together alone almost exactly about around nearly enough several
whole entire average total remaining extra equal different important possible necessary correct
incorrect final initial beautiful strong weak heavy light bright dark clean dirty busy quiet loud
rich poor kind friendly careful careless brave clever curious hungry thirsty tired sleepy
Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Kate Liam Mia Noah Olivia Paul Quinn Rose
Sam Tom Uma Victor Wendy Xavier Yara Zoe John Mary James Linda Sarah Peter Anna Mark Lucy Ben Sofia
""".split()

QUESTION_STARTS = ["What is", "How much is", "Compute", "Calculate", "Please compute", "Can you compute"]
OPS = ["+", "-", "*"]


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _number(rng: random.Random) -> int:
    return rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 999), rng.randint(0, 9999)])


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), str(_number(rng)))
    if rng.random() < 0.2:
        words[rng.randrange(len(words))] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!"])


def _arithmetic(rng: random.Random) -> str:
    a, b, op = _number(rng), _number(rng), rng.choice(OPS)
    expr = f"{a} {op} {b}"
    kind = rng.randrange(4)
    if kind == 0:
        return f"{expr} = {_apply(a, op, b)}"
    if kind == 1:
        return f"Q: {rng.choice(QUESTION_STARTS)} {expr}?\nA: {_apply(a, op, b)}"
    if kind == 2:
        return f"user: {rng.choice(QUESTION_STARTS)} {expr}?\nassistant: The answer is {_apply(a, op, b)}."
    args = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return f"<tool_call>{args}</tool_call>\n{_apply(a, op, b)}"


def synthetic_corpus(seed: int = CORPUS_SEED, n_lines: int = CORPUS_LINES) -> Iterator[str]:
    """English-like sentences, numbers, arithmetic and chat/tool-call snippets, reproducibly."""
    rng = random.Random(seed)
    for _ in range(n_lines):
        yield _sentence(rng) if rng.random() < 0.55 else _arithmetic(rng)


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on the synthetic corpus.

    Deterministic whatever the thread count: the trainer breaks ties between equally frequent pairs
    by the pair itself (checked with RAYON_NUM_THREADS 1 to 16).
    """
    tok = Tokenizer(BPE())
    # NFC, as transformers' Qwen2Tokenizer (what AutoTokenizer picks for a qwen2 config) adds it.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return tok


def _hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_PARAMS["max_position_embeddings"],
    )


def _build(dest: Path, seed: int) -> None:
    tokenizer = _hf_tokenizer(train_tokenizer())
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        **MODEL_PARAMS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _builder_hash() -> str:
    """Hash of this module's source: changing any parameter (or the code) builds a new directory."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def build_tiny(seed: int = 0) -> Path:
    """The cached directory of the tiny model for `seed`, built on first use."""
    return cached_build(f"tiny-seed{seed}-{_builder_hash()}", lambda dest: _build(dest, seed))
