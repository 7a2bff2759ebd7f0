"""Builds stdlib-chat.jsonl: conversations in the messages format made from stdlib-docstrings.jsonl (real
English prose from CPython's standard library docstrings, PSF License; see README.md), for chat
fine-tunes (data.format: messages).

    python examples/data/make_chat_corpus.py   # rewrites examples/data/stdlib-chat.jsonl

Each docstring of at least two paragraphs becomes one conversation: the user quotes its first paragraph and
where it is from and asks for more; the assistant answers with the paragraphs that follow, cut at a paragraph
end within MAX_ANSWER characters. The answer is the docstring's own text, so what is learned is real prose.
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM = "You explain Python's standard library, in the words of its documentation."
MAX_QUESTION = 300
MAX_ANSWER = 400
MAX_CONVERSATIONS = 800
SOURCE = Path(__file__).with_name("stdlib-docstrings.jsonl")
OUTPUT = Path(__file__).with_name("stdlib-chat.jsonl")


def conversation(text: str, source: str) -> dict[str, object] | None:
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(paragraphs) < 2 or len(paragraphs[0]) > MAX_QUESTION:
        return None
    answer = ""
    for paragraph in paragraphs[1:]:
        longer = f"{answer}\n\n{paragraph}" if answer else paragraph
        if len(longer) > MAX_ANSWER:
            break
        answer = longer
    if not answer:
        return None
    question = f'{source} says: "{paragraphs[0]}" What else does its documentation say?'
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        "source": source,
    }


def main() -> None:
    written = 0
    with SOURCE.open(encoding="utf-8") as rows, OUTPUT.open("w", encoding="utf-8") as out:
        for line in rows:
            row = json.loads(line)
            made = conversation(row["text"], row["source"])
            if made is None:
                continue
            out.write(json.dumps(made, ensure_ascii=False) + "\n")
            written += 1
            if written == MAX_CONVERSATIONS:
                break
    print(f"{OUTPUT.name}: {written} conversations, {OUTPUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
