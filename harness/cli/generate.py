"""`fragbench generate`: offline generation through any in-house engine, with the server's own checks."""

from __future__ import annotations

import argparse
import json

from engines import ENGINES
from harness.cli.args import UsageError, fraction_arg, nonneg_float, positive_int
from harness.cli.engine_flags import add_engine_flags, engine_from_flags
from harness.cli.seeds import seed_arg


def prompt_ids_arg(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, not {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def register(sub) -> None:
    gen = sub.add_parser("generate", help="offline generation through any engine")
    add_engine_flags(gen, ENGINES)
    gen.add_argument("--prompt", action="append", default=[],
                     help="a prompt's text, tokenized by the model's tokenizer (repeatable; or --prompt-ids)")
    gen.add_argument("--prompt-ids", type=prompt_ids_arg, action="append", default=[],
                     help="a prompt as comma-separated token ids (repeatable; or --prompt)")
    gen.add_argument("--max-tokens", type=positive_int, required=True, help="output tokens per sample, at most")
    gen.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=fraction_arg, default=1.0, help="nucleus sampling's probability mass (0-1]")
    gen.add_argument("--seed", type=seed_arg, help="the sampler's seed (default: none, a fresh draw)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--json", action="store_true", help="print each sample as a JSON line instead of its text")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.prompt_ids):
        raise UsageError("give prompts either as --prompt TEXT or as --prompt-ids 1,2,3 (each may repeat)")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, not {args.temperature}")
    engine = engine_from_flags(args)
    try:
        return generate_with(engine, args)
    finally:  # hf-cb runs a manager thread of its own: it must stop, error or not
        getattr(engine, "close", lambda: None)()


def generate_with(engine, args: argparse.Namespace) -> int:
    # imported when the verb runs: `fragbench --help` does not load torch or transformers
    from transformers import AutoTokenizer

    from engines.api.validation import InvalidRequest, check_engine, check_lengths, check_prompts
    from engines.offline import generate
    from engines.sequence import SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = args.prompt_ids or [tok(t).input_ids for t in args.prompt]
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p, args.seed, args.ignore_eos)
    try:  # the server's own checks, so that generate and serve refuse the same things
        check_prompts(prompts, engine.vocab_size, engine.max_seq_len)
        check_lengths(prompts, args.max_tokens, engine.max_seq_len)
        check_engine(engine, params)
    except InvalidRequest as e:
        raise UsageError(f"{e} (--{'prompt-ids' if e.param == 'prompt' else e.param.replace('_', '-')})") from None
    peak: dict = {}

    def track_peak() -> None:
        s = engine.stats()
        if s.allocated_bytes > peak.get("allocated_bytes", -1):
            peak.update(s.to_json())

    engine.poll = track_peak
    results = generate(engine, prompts, params, args.n, after_step=track_peak)
    outputs = [
        {"prompt_ids": o.prompt_ids, "token_ids": o.token_ids, "text": tok.decode(o.token_ids),
         "finish_reason": o.finish_reason, **({"sample": o.sample} if args.n > 1 else {})}
        for per_prompt in results for o in per_prompt
    ]
    if args.json:
        print(json.dumps({"engine": args.engine, "outputs": outputs, "peak_stats": peak,
                          "stats": engine.stats().to_json()}))
    else:
        for o in outputs:
            tag = f" [sample {o['sample']}]" if "sample" in o else ""
            print(f"{len(o['prompt_ids'])} prompt tokens{tag} -> {o['text']!r} ({o['finish_reason']})")
    return 0
