"""Talk to `ouroboros-local serve` with the official OpenAI Python client (pip install openai).

    ouroboros-local serve -m smollm2-135m-instruct            # in another terminal
    python examples/openai_client.py [--base-url http://127.0.0.1:8080/v1] [--api-key KEY]

The server speaks the OpenAI API; its extensions (top_k, min_p, a per-request decoding `method`
and `method_options`) go in `extra_body`, and each response carries a `stats` object.
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default=os.environ.get("OUROBOROS_API_KEY", "not-needed"),
                   help="the server's --api-key, if it has one (default: $OUROBOROS_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Explain speculative decoding in one sentence."}]

    # Non-streaming chat completion (greedy: temperature 0).
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                          temperature=0)
    stats = (resp.model_extra or {}).get("stats", {})
    print(f"--- chat ---\n{resp.choices[0].message.content}")
    print(f"[{stats.get('method')}] {resp.usage.completion_tokens} tokens, "
          f"{stats.get('tokens_per_second', 0):.1f} tok/s, finish: {resp.choices[0].finish_reason}")

    # Streaming: the same answer, piece by piece. Both are the target's greedy text, but each round's
    # batch shape moves the logits slightly, so the two may part where the model's top two tokens nearly
    # tie (README, "Exactness on real hardware"); with --method vanilla they are identical.
    print("--- streaming ---")
    pieces = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                print(choice.delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n(usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion)")
    same = "".join(pieces) == resp.choices[0].message.content
    print(f"identical to the non-streaming answer: {same}{'' if same else ' (a near-tie flipped, see above)'}")

    # Plain completion with extensions: pick the decoding method per request, sample with a seed.
    comp = client.completions.create(model=model, prompt="def fibonacci(n):\n", max_tokens=args.max_tokens,
                                     temperature=0.7, top_p=0.95, seed=7, stop=["\n\n\n"],
                                     extra_body={"top_k": 40, "min_p": 0.05, "method": "vanilla"})
    print(f"--- completion (vanilla, sampled) ---\n{comp.choices[0].text}")

    # Errors come back as OpenAI-style exceptions.
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    except openai.BadRequestError as exc:
        print(f"--- a bad request is refused ---\n{exc.status_code}: {exc.message}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
