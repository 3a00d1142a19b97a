"""verify.py: a rule-based checker for final answers of math solutions.

In PACS the verifier *is* the reward: a false positive is a reward the policy learns to
hack, a false negative punishes a correct answer. So this checker is strict where
strictness is cheap (the last `\\boxed{}` is the answer; integers compare exactly; a
list of candidates is not an answer) and lenient only where the notation, not the
mathematics, differs (`\\dfrac12` = `0.5` = `50\\%`, `x = 5` = `5`, `025` = `25`).

    from verify import verify, extract_answer, is_equiv
    verify(r"... so the answer is $\\boxed{\\frac{14}{3}}$.", r"\\frac{14}{3}")   # True
    extract_answer(r"\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}")           # '\\left( 3, ...'
    is_equiv("x = 1, x = 2", "2,1")                                          # True

    python verify.py RESPONSE GOLD          # prints the extracted answer and the verdict
    python verify.py --jsonl FILE           # scores {response, answer[, expected]} rows

How a comparison runs:

1. `extract_answer` takes the last `\\boxed{...}` / `\\fbox{...}` (boxes that end the
   response side by side, `\\boxed{1}, \\boxed{2}`, are read as one list; `verify` also lets
   a list gold be given box by box, see there), unless a final-answer statement follows it;
   without a box, and unless `strict=True`, "the final answer is ...", "answer: ...", "#### ..."
   (and their French, Spanish, German, Russian, Chinese, Hindi, Arabic ... forms; a plural cue,
   "the answers are 3 and 5", states the whole list), then a bare one-line answer, then the last
   `$...$` span or the last value (a number, or a `\\frac` whole), whichever comes later.
2. `is_equiv` normalises both strings (`\\left`, spacing, `\\dfrac`, `^\\circ`, `\\%`,
   `\\$`, units, thousands separators, scale words ...), splits structure in plain Python
   (lists, sets, tuples, intervals, unions, matrices and their sums and products, equations,
   inequalities, labelled values `PQ = 3`, ratios `5:12`),
   compares plain numbers exactly with `fractions.Fraction` (the fast path), and only
   sends the remaining leaves to sympy.
3. sympy runs in one persistent worker subprocess per process, started lazily. Each
   comparison gets a time budget (`TIMEOUT`, 1 s): the worker interrupts itself with
   `SIGALRM` (it is its own main thread) and the caller kills it if it still does not
   answer; a timeout means "not equal". This works from any thread and inside
   multiprocessing workers (daemonic ones too), and keeps `import verify` free of sympy.
   The worker's address space is capped, and LaTeX is translated to sympy by a small
   hand-written parser that refuses huge exponents, towers and deep nesting before
   sympy ever sees them. One worker serves all threads of a process (requests queue on a
   lock). POSIX only: it relies on select() on pipes and SIGALRM.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import random
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction

TIMEOUT = 1.0  # seconds of sympy work allowed for one comparison
MAX_RESPONSE = 100_000  # only the tail of longer responses is searched for a box
MAX_TAIL = 5_000  # ... and only this much of it for the fallbacks (answers come last)
MAX_ANSWER = 1_000  # longer answers are compared as normalised strings only
MAX_DEPTH = 20  # deeper bracket nesting is compared as a string only
MAX_ITEMS = 16  # larger lists / sets / matrices are compared as strings only
WORKER_MEMORY = 2 << 30  # address-space cap (bytes) of the sympy worker

# ---------------------------------------------------------------------------------------
# 1. Extraction: what counts as the final answer
# ---------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
# What may separate boxes that are read together: spaces, commas, "and"/"or", math delimiters.
_BOX_GAP = re.compile(r"(?:\s|[,;&]|\$|\\[\[\]()]|\\q?quad|\\text\{\s*(?:and|or)?\s*\}|and|or)*")
# Answer cues in the languages models answer in: an answer noun, then a copula or a colon ("the
# answer is", "Answer:", "la réponse est", "die Antwort lautet", "Ответ:", "答案是", "答えは"). A
# final-answer noun may also end its line, as a heading does ("**Final Answer**", then the answer);
# after the last box, only a final-answer cue states the answer that box was not (_stated_after_box).
_FINAL = (r"final answer|réponse finale|respuesta final|resposta final|risposta finale|endantwort|endgültige antwort|"
          r"окончательный ответ|最终答案|最終答案|最終的な答え|최종 답")
_ANSWER = (r"(?:answer|réponse|respuesta|resposta|risposta)s?|antwort|antwoord|ответ|відповідь|odpowiedź|cevap|"
           r"jawaban(?:nya)?|đáp án|đáp số|उत्तर|الجواب|الإجابة|答案|答え|解答|答|정답|답")
# A plural cue states every answer: "The answers are 3 and 5." is `3 and 5` (a list), as "the two answers: 7 and 11".
_COPULA = (r"(?:is|are|est|sont|es|son|é|são|è|sono|ist|sind|lautet|равен|равна|равно|будет|هو|هي|là|adalah)\b|"
           r"是(?!否)|为|為|は|은|는|—|[:：=]")
_FINAL_NOUN = rf"(?:{_FINAL})(?:[*\s]*(?:{_COPULA})|[*# \t]*\n)"
_FINAL_CUE = re.compile(_FINAL_NOUN + r"[*\s]*[:：]?", re.I)
_CUE = re.compile(rf"(?:{_FINAL_NOUN}|(?:{_ANSWER})(?:\s+(?:correct[ae]?|corret[ao]|corrett[ao]))?[*\s]*(?:{_COPULA})"
                  rf"|\b(?:ist|lautet) die (?:end)?antwort\b)[*\s]*[:：]?|####", re.I)
# What may stand between a cue and its answer ("the answer is therefore 5", "la réponse est donc 5").
_CONNECTIVE = re.compile(r"(?:(?:therefore|thus|hence|so|then|donc|alors|ainsi|entonces|pues|portanto|então|logo|"
                         r"quindi|dunque|also|daher|somit|итак|значит)\b[,\s]*)+", re.I)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
# Bounded spans: an unbounded lazy `.+?` rescans the rest of the text from every `\(`.
# An escaped dollar `\$` neither opens nor closes a span (`$ \frac{3}{4} \$ = \frac{5}{2} $` is one span).
_SPAN = re.compile(r"(?<!\\)\$\$(.{1,1000}?)(?<!\\)\$\$|(?<!\\)\$((?:\\.|[^$\\]){1,1000}?)\$|"
                   r"\\\((.{1,1000}?)\\\)|\\\[(.{1,1000}?)\\\]",
                   re.S)
# A number glued to a letter on its left is part of a word or a name (`AB2C`, `x2y`, `H2O`,
# `a_2`), never a final answer; letters only on its right (`5cm`, `3rd`) are a unit or an ordinal.
_NUMBER = re.compile(r"(?<![A-Za-z_\d])(?:-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+)")
# A value in text outside math delimiters: a `\frac` is one value (not its denominator), else a number.
_VALUE = re.compile(r"-?\\[dt]?frac(?:\{[^{}]{1,50}\}|\d)(?:\{[^{}]{1,50}\}|\d)|" + _NUMBER.pattern)
# A duration introduced by a preposition (`en 6 mois`, `in 6 months`, `за 6 месяцев`, `在6个月内`) restates
# the question's terms; after a cue in prose it is the answer only when no other value is there.
_DURATION_BEFORE = re.compile(r"(?:\b(?:in|within|over|for|after|during|en|dans|sur|pendant|durant|durante|dentro de|"
                              r"innerhalb von|nach|über|за|через|в течение)\s+|[在用花]\s*)$", re.I)
_DURATION_AFTER = re.compile(r"\s*(?:(?:months?|days?|weeks?|years?|hours?|minutes?|mois|jours?|semaines?|ans|"
                             r"années?|heures?|meses|días|dias|semanas|años|anos|horas|minutos|monaten?|"
                             r"tagen?|wochen?|jahren?|stunden?|месяц\w*|дн\w*|недел\w*|год\w*|лет|час\w*|"
                             r"минут\w*)(?![^\W\d_])|个月|天|周|年|小时|分钟)", re.I)
# A relation between a variable and the last number is the answer, not the number alone:
# `y <= 7`, `t >= -3`, `n != 4`, `-2 <= x < 7` (a chain from a number through the variable).
_RELATION_BEFORE = re.compile(r"(?:(?<![\w.])-?\d+(?:\.\d+)?\s*(?:<=|<|≤)\s*)?(?<![A-Za-z\\])[a-zA-Z](?:_\{?\w+\}?)?"
                              r"\s*(?:<=|>=|\s!=|<|>|≤|≥|≠)\s*$")


def _undouble(s: str) -> str:
    """Text JSON-encoded twice has every backslash doubled (`\\\\sqrt{2}`, `\\\\left[`). Singly
    escaped LaTeX writes a command with one backslash (three after a row break `\\\\`), so when
    every command in `s` has an even run of backslashes, halve every run."""
    runs = [m.end() - m.start() for m in re.finditer(r"\\+(?=[a-zA-Z])", s)]
    if runs and all(r % 2 == 0 for r in runs):
        return s.replace("\\\\", "\\")
    return s


def _box_arg(s: str, i: int):
    """The argument of a box command whose name ends at `i`: (text, end) or None."""
    j = i
    while j < len(s) and s[j] == " ":
        j += 1
    if j < len(s) and s[j] == "{":
        depth, k = 0, j
        while k < len(s):
            c = s[k]
            if c == "\\":  # `\{`, `\}` and `\\` are not group braces
                k += 2
                continue
            depth += (c == "{") - (c == "}")
            if depth == 0:
                return s[j + 1 : k], k + 1
            k += 1
        return None  # unbalanced: a truncated generation has no answer
    m = re.match(r"[^\s$]+", s[j:])  # `\boxed 5`: one token (a sentence's period is not in it)
    return (m.group(0).rstrip(".,;"), j + m.end()) if m else None


def _boxes(s: str) -> list:
    """The outermost boxes as (start, end, content); a box inside a box is part of its content
    (so `\\boxed{\\boxed{5}, 6}` answers `\\boxed{5}, 6`). An unclosed box ends the list."""
    out, end = [], -1
    for m in _BOX.finditer(s):
        if m.start() < end:
            continue
        arg = _box_arg(s, m.end())
        out.append((m.start(), None, None) if arg is None else (m.start(), arg[1], arg[0]))
        if arg is None:
            break
        end = arg[1]
    return out


def _boxed(s: str):
    """Content of the last box, or None. Boxes that close the response side by side
    (`\\boxed{-2} and \\boxed{1}`) are joined into one list, so a list answer can be
    written box by box; boxes separated by any prose are not (the last one counts)."""
    parts = _box_group(s)
    return None if parts is None else ", ".join(dict.fromkeys(parts))  # the same box twice is one answer


def _box_group(s: str):
    """The contents of the boxes that close the response side by side (one item for a lone
    last box), or None when the last box is unclosed or there is none."""
    boxes = _boxes(s)
    if not boxes or boxes[-1][2] is None:
        return None
    parts, begin = [boxes[-1][2].strip()], boxes[-1][0]
    for start, end, content in reversed(boxes[:-1]):
        if begin - end > 40 or not _BOX_GAP.fullmatch(s[end:begin]):
            break
        parts.insert(0, content.strip())
        begin = start
    for i, p in enumerate(parts):  # `\\boxed{\\boxed{5}}` is `5` (a few levels; deeper is junk)
        for _ in range(3):
            inner = _boxes(p)
            if not (len(inner) == 1 and inner[0][0] == 0 and inner[0][1] == len(p)):
                break
            p = parts[i] = inner[0][2].strip()
    return parts


def _after_last_equals(x: str, chain: bool = False) -> str:
    """`\\frac12 \\cdot 10 = 5` -> `5`; keeps `x = 5` (an assignment), `... = 0` (an equation)
    and inequalities (`y <= 7` holds an `=` that is not an equals sign). With `chain`, only a
    chain of equalities ending in a constant gives its last member (`3y = 2x = \\frac74`), or a
    computation with numbers on the left (`12 + 30 = 42`): after an answer cue, `x + y = 5` is an equation."""
    bits = []
    for bit in _split_top(x, "="):  # the `=` of `<=`, `>=`, ` !=` belongs to the relation (`5!=120` is a factorial)
        if bits and re.search(r"[<>]$|\s!$", bits[-1]):
            bits[-1] += "=" + bit
        else:
            bits.append(bit)
    if len(bits) > 1 and not _is_name(bits[0].strip()) and bits[-1].strip() not in ("0", ""):
        computed = all(_is_constant(b) and re.search(r"\d", b) for b in bits[:-1])  # `12 + 30 = 42`: a sum worked out
        if not chain or (len(bits) > 2 and _is_constant(bits[-1])) or computed:
            return bits[-1]
    return x


def _prose(text: str) -> bool:
    """Words, not math: two words outside LaTeX commands (three letters or more in any alphabet,
    not all capitals: `RPS` names a figure), or any CJK character."""
    words = re.findall(r"(?=[^\W\d_]*[^\W\d_A-Z])[^\W\d_]{3,}", re.sub(r"\\[a-zA-Z]+(\{[^{}]*\})?", " ", text))
    return len([w for w in words if w.lower() not in ("and", "or")]) >= 2 or bool(_CJK.search(text))


def _currency_prose(text: str) -> bool:
    """Is a `$...$` "span" words that open or close with an amount (`$75 and she pays $`,
    `15 $, so five books cost 75 $`): currency signs around prose, not math?"""
    return bool(re.match(r"\s*\d|.*\d\s*$", text, re.S)) and _prose(text)


def _math_span(seg: str):
    """The content of the math span that opens `seg`, or None."""
    m = _SPAN.match(seg)
    text = next(g for g in m.groups() if g is not None) if m else None
    return None if text is None or _currency_prose(text) else text


def _clean_cue(seg: str, prose: bool = True):
    """Turn the text after an answer cue into an answer: the first math span, else the
    clause up to the sentence end, reduced to what follows "is" (in any language) and cut
    where a comma, a semicolon or a parenthesis opens a word (`42, denn 6 · 7 = 42`, `12
    (vérification : ...)`), else (if `prose`) the value of a clause of prose (_prose_value).
    Parentheses around the whole answer are dropped unless they hold a tuple: `(12 + 30 = 42)`."""
    seg = _CONNECTIVE.sub("", seg.strip(), count=1)
    span = _math_span(seg)
    if span is not None:
        return _unparen(span)
    seg = re.split(r"\.(?:\s|$)|。|।|\n| I hope", seg)[0]
    seg = re.split(r"\b(?:is|are|est|sont|es|son|é|è|ist|sind|lautet)\b|是|为|為|は", seg)[-1].strip()
    seg = _CONNECTIVE.sub("", seg, count=1)
    span = _math_span(seg)
    if span is not None:
        return _unparen(span)
    head = re.split(r"(?:[,;]\s*|\s\()(?!(?:and|or|et|ou|und|oder|или)\b)(?=[^\W\d_]{2,})", seg)[0].strip()
    if head and not _prose(head):
        return _unparen(head)
    if _prose(seg):
        return _prose_value(seg) if prose else None
    return seg or None


def _prose_value(seg: str):
    """The answer a clause of prose after a cue states: its last parenthesised expression without
    words (`每人分到 (\\frac{3}{7}) 千克`), else its last value (a `\\frac` whole, or a number), not
    counting a duration the question set (`il lui reste 150 $ à rembourser en 6 mois` is 150) unless
    it is the only value; None without one."""
    groups = [g for g in re.findall(r"\(([^()]{1,200})\)", seg) if re.search(r"\d", g) and not _prose(g)]
    if groups:
        return groups[-1].strip()
    values = list(_VALUE.finditer(seg))
    kept = [m for m in values if not (_DURATION_BEFORE.search(seg[max(0, m.start() - 20) : m.start()])
                                      and _DURATION_AFTER.match(seg, m.end()))]
    if not values:
        return None
    m = (kept or values)[-1]  # a scale or percent word stays with its number: `150 тысяч`, `5万`, `35 por ciento`
    scale = _SCALE_AFTER.match(seg, m.end())
    if scale and _SCALE_WORD.fullmatch(scale.group(0)):
        return m.group(0) + scale.group(0)
    return m.group(0)


def _unparen(x: str) -> str:
    """`(12 + 30 = 42)` -> `12 + 30 = 42`; a tuple or an interval (`(3, 4)`) keeps its brackets."""
    x = x.strip()
    if x[:1] == "(" and x[-1:] == ")" and _wrapped(x) and len(_split_top(x[1:-1], ",")) == 1:
        return x[1:-1].strip()
    return x


def _stated_after_box(s: str):
    """The answer of an explicit final-answer statement after the last box ("... the first part
    is \\boxed{48} ... Final Answer: The final answer is $5,280$."), or None. It must state a
    math span or a short clause: prose that only mentions a number ("this final answer is
    consistent with the first part, 48") restates a step and leaves the box the answer."""
    if not _FINAL_CUE.search(s, max(s.rfind("\\boxed"), s.rfind("\\fbox"))):
        return None  # the common case, found without parsing a box
    boxes = _boxes(s)
    if boxes[-1][1] is None:
        return None  # an unclosed last box
    tail = s[boxes[-1][1] :][-MAX_TAIL:]
    cues = list(_FINAL_CUE.finditer(tail))
    if not cues:
        return None
    ans = _clean_cue(tail[cues[-1].end() : cues[-1].end() + 400], prose=False)
    return _after_last_equals(ans, chain=True).strip() or None if ans and ans.strip() else None


def extract_answer(response: str, strict: bool = False) -> str | None:
    """The final answer of a model response, or None.

    The last `\\boxed{...}`/`\\fbox{...}` wins, unless an explicit final-answer statement
    follows it ("Final Answer: The final answer is $5,280$."); an empty or unclosed last box is
    no answer (a response that boxes is judged by its box alone). With `strict=True` only boxes
    count. Otherwise: the last answer cue ("the final answer is", "answer:", "####"), then the
    last `$...$` / `\\(...\\)` / `\\[...\\]` span or the last number, whichever is later.

    Policies: a plural cue states every answer ("The answers are 3 and 5." is `3 and 5`, like "So
    the two answers: 7 and 11"). In a clause of prose after a cue, a duration introduced by a
    preposition (`en 6 mois`, `in 6 months`) restates the question and is skipped unless it is the
    only value ("il lui reste 150 $ à rembourser en 6 mois" is 150); a scale or percent word stays
    with its number (`5万`, `150 тысяч`). "So" / `所以` is no cue: the fallback reads that sentence.
    A response that is one line of math without words (`(2,9)or(9,2)`) is read whole. An escaped
    `\\$` neither opens nor closes a span.
    """
    return _extract(response, strict)[0]


def _extract(response: str, strict: bool):
    """(answer, searched text, whether the answer is the response's boxes)."""
    if not isinstance(response, str):
        return None, "", False
    s = _undouble(response[-MAX_RESPONSE:])
    if _BOX.search(s):
        stated = None if strict else _stated_after_box(s)
        if stated is not None:
            return stated, s, False
        box = _boxed(s)
        return (box.strip() or None if box is not None else None), s, True
    if strict:
        return None, s, False
    return _unboxed(s[-MAX_TAIL:]), s, False


def _unboxed(s: str):
    """The answer of a response without a box: its last answer cue, else its last math span or
    its last number, whichever comes later."""
    cues = list(_CUE.finditer(s))
    if cues:
        ans = _clean_cue(s[cues[-1].end() : cues[-1].end() + 400])
        if ans and ans.strip():
            return _after_last_equals(ans, chain=True).strip()
    bare = s.strip()  # a bare answer, one line of math without words: `(2,9)or(9,2)`, `\frac{1}{2}`, `x = 5`
    if (len(bare) <= 200 and re.search(r"\d", bare) and not re.search(r"[\n$]|\\[(\[]|[^\x00-\x7f−×·÷√π≤≥≠∪±∞°]", bare)
            and not re.search(r"[A-Za-z]{3,}", re.sub(r"\\[a-zA-Z]+", " ", bare))):
        bare = re.sub(r"\s+is\s+", " = ", bare)  # `12 + 13 is 25` states 25, as `12 + 13 = 25` does
        return _after_last_equals(re.sub(r"(?<!\.)\.$", "", bare)).strip() or None
    spans = [m for m in _SPAN.finditer(s) if not _currency_prose(next(g for g in m.groups() if g is not None))]
    nums = list(_VALUE.finditer(s))  # `所以每人分到 \frac{3}{7} 千克` ends in 3/7, not 7
    if spans and (not nums or spans[-1].end() >= nums[-1].end()):
        text = next(g for g in spans[-1].groups() if g is not None).strip().rstrip(".,")
        return _after_last_equals(text).strip() or None
    if not nums:
        return None
    rel = _RELATION_BEFORE.search(s, max(0, nums[-1].start() - 40), nums[-1].start())
    return s[rel.start() if rel else nums[-1].start() : nums[-1].end()]


# ---------------------------------------------------------------------------------------
# 2. Normalisation: notation that never changes the value
# ---------------------------------------------------------------------------------------

_UNICODE = {"−": "-", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ", "√": "\\sqrt", "π": "\\pi ",
            "≤": "\\le ", "≥": "\\ge ", "≠": "\\ne ", "∪": "\\cup ", "±": "\\pm ", "∞": "\\infty ",
            "°": "", "\u00a0": " "}
_UNITS = (r"(?:square |sq\.? |cubic )?(?:units?|cm|mm|km|meters?|metres?|inch(?:es)?|in|feet|foot|ft|"
          r"yards?|yd|miles?|mi|kg|grams?|pounds?|lbs?|seconds?|sec|minutes?|min|hours?|hrs?|days?|"
          r"weeks?|months?|years?|degrees?|deg|radians?|dollars?|cents?|euros?|yen|yuan|rupees?|pesos?|mph|"
          r"people|students|ways)")
_ROW = "\ue000"  # stands for `\\` (not whitespace, unlike \x1e)
_TEXTCMD = r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|boldsymbol|operatorname)"
_UNITCMD = r"\\(?:text|textbf|textit|textrm|textnormal|mbox)"


# Words that count or scale, never units: `2 \text{ thousandths}` is not 2.
_COUNTS = (r"(?:hundred|thousand|million|billion|trillion|dozen|halves|thirds|quarters|fourths|fifths|sixths|sevenths|"
           r"eighths|ninths|tenths)(?:th|ths|s)?\b")
# ... in the other languages of the answer cues: never dropped as a unit or counted object either.
_COUNTS_ABROAD = (r"(?i:(?:mil|mille|milles|mila|mill[oó]n(?:es)?|millions?|millionen|milione|milioni|milh[ãa]o|"
                  r"milh[õo]es|milhares?|milliards?|milliarden?|miliardo|miliardi|hundert|tausend|cent|centaines?|"
                  r"dizaines?|douzaines?|docenas?|dutzend|dozzin[ae]|centenas?|decenas?|demis?|tiers|quarts?|"
                  r"\w+i[eè]mes?|medios?|tercios?|cuartos?|quintos?|sextos?|s[eé]ptimos?|octavos?|novenos?|"
                  r"d[eé]cimos?|cent[eé]simos?|mil[eé]simos?|\w+avos?|ter[çc]os?|mezzi?|terzi?|quarti?|sesti?|"
                  r"settimi?|ottavi?|noni?|decimi?|centesimi?|millesimi?|halbe[n]?|\w+tel|fois|veces|vezes|volte|mal|"
                  r"тысяч\w*|миллион\w*|миллиард\w*|сот\w*|десят\w*|дюжин\w*|половин\w*|трет\w*|четверт\w*|пят\w*|"
                  r"шест\w*|седьм\w*|восьм\w*|девят\w*|раз|हज़ार|हजार|लाख|करोड़|सौ|"
                  r"ألف|آلاف|مليون|ملايين|مليار|مئة|مائة)(?![^\W\d_]))")
# A unit or counted object after a number, in any script (`12 Äpfel`, `150 рублей`, `42 दिन`); CJK counters
# and units (`5 个`, `3 千克`, `7 円`), never a CJK scale (`5万` is 50000, `3 千` is 3000, `2倍` twice).
_WORD_ABROAD = r"(?=[^\s]*[^\x00-\x7f])(?:[^\W\d_]|[\u0300-\u036f\u0900-\u097f\u0600-\u06ff]){3,}"
_CJK_UNIT = r"(?![十百万萬亿億兆倍半만억천백십]|千(?![克米瓦])|分之)[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]+"
_PERCENT = r"(?:percent|pct|prozent|pour ?cent|por ?ciento|per ?cento|por ?cento|процент\w*|प्रतिशत)"
_PERCENT_WORD = re.compile(r"(?<=[\d}])\s*" + _PERCENT + r"(?![^\W\d_])", re.I)
_UNIT_TEXT = re.compile(r"^(.*?[^\s,])\s*" + _UNITCMD + r"\{(?!\s*(?:" + _COUNTS + "|" + _COUNTS_ABROAD + "|"
                        + _PERCENT + r"))[^{}\d]*\}(?:\^\{?\d\}?)?\s*\.?$")
_OBJECT = re.compile(r"^([-+]?[\d.]+)\s+(?!(?:sin|cos|tan|log|ln|exp|not|maybe|one|two|three|four|five|six|seven|"
                     r"eight|nine|ten)\b|" + _COUNTS + r"|" + _COUNTS_ABROAD + r")[A-Za-z]{3,}$")
_OBJECT_ABROAD = re.compile(r"^([-+]?\d+(?:\.\d+)?|\\frac\{\d+\}\{\d+\})\s*(?:(?<=\s)(?!" + _COUNTS_ABROAD + ")"
                            + _WORD_ABROAD + "|" + _CJK_UNIT + r")$")
# What may follow the value a clause of prose states and stays with it (`150 тысяч`, `5万`, `35 por ciento`).
_SCALE_AFTER = re.compile(r"\s*(?:[十百万萬亿億兆倍]|千(?![克米瓦])|" + _PERCENT + r"|[^\W\d_]+)", re.I)
_SCALE_WORD = re.compile(r"\s*(?:[十百千万萬亿億兆倍]|" + _COUNTS + "|" + _COUNTS_ABROAD + "|" + _PERCENT + ")", re.I)
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_SCALED = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*(" + _UNITCMD + r"\s*\{\s*)?"
                     r"(hundred|thousand|million|billion|trillion)(?![a-zA-Z])")
_SMALL = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                     "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}


def _scaled(m) -> str:
    """`3.5 thousand` -> `3500`; a value that is not a whole number keeps its words."""
    value = Fraction(m.group(1)) * _SCALES[m.group(3)]
    if value.denominator != 1:
        return m.group(0)
    return str(value.numerator) + (m.group(2).strip()[:-1] + "{" if m.group(2) else "")


def _number_words(s: str) -> str:
    """A whole answer written in words is its number: `five` = 5, `Twenty-one` = 21,
    `two million` = 2000000. Only the whole string: words inside text stay text."""
    m = re.fullmatch(r"(?i)(?:(twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)(?:[- ]([a-z]+))?|([a-z]+))"
                     r"(?: (hundred|thousand|million|billion|trillion))?", s.strip())
    if not m:
        return s
    tens, unit, small, scale = [g.lower() if g else g for g in m.groups()]
    if tens:
        if unit is not None and (unit not in _SMALL or not 0 < _SMALL[unit] < 10):
            return s
        value = _TENS[tens] + (_SMALL[unit] if unit else 0)
    elif small in _SMALL:
        value = _SMALL[small]
    else:
        return s
    return str(value * (_SCALES[scale] if scale else 1))


def normalize(s: str) -> str:
    """Canonical spelling of an answer string (spaces kept, collapsed)."""
    s = _undouble(s)
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = re.sub(r"\s+", " ", s)  # first: with single spaces no `\s*` below can backtrack badly
    s = s.replace("\\\\", _ROW)  # LaTeX row break: a matrix row separator, else a space
    for _ in range(8):  # unwrap boxes (a gold may come boxed): `x \in \boxed{[0, 1]}`
        m = _BOX.search(s)
        arg = _box_arg(s, m.end()) if m else None
        if arg is None:
            break
        s = s[: m.start()] + arg[0] + s[arg[1] :]
    # Thousands separators that cannot be list commas: `10,\!080`, `14{,}916`, `1\,000`.
    s = re.sub(r"(\d)\s*(?:\{\s*,\s*\}|,\s*\\!\s*|\\,)\s*(?=\d{3}(?!\d))", r"\1", s)
    s = re.sub(r"\\(?:left\.|right\.|displaystyle|textstyle|!|(?:no)?limits(?![a-zA-Z]))", "", s)
    s = re.sub(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])", "", s)
    s = re.sub(r"\s*,?\s*\\q?quad\s*(?=[a-zA-Z](?:_\{?\w+\}?)?\s*=)", ";", s)  # `x = 2, \quad x = 1`: two answers
    s = re.sub(r"\\[,:; ]|\\q?quad(?![a-zA-Z])|~", " ", s)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![a-zA-Z])", r"\\binom", s)
    s = re.sub(r"\\colon(?![a-zA-Z])|\\mathbin\{:\}|\\ratio(?![a-zA-Z])", ":", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("**", "^")
    s = re.sub(r"\\[()\[\]]", " ", s)  # math delimiters inside a box: `\boxed{4 \) and \( 5}`
    # currency signs, like `$`
    s = re.sub(r"[€£¥₹₽₩]|\\(?:euro|pounds|yen|textdollar|texteuro|textsterling|textyen)(?![a-zA-Z])", "", s)
    # Answers joined by words are solutions, separated like groups (`x = 1 \text{ or } x = 2`,
    # `x=1, y=2 \text{ or } x=2, y=1`, `6, 8, and 10`); see _parse.
    s = re.sub(r"\s*,?\s*(?:\\text\{\s*,?\s*(?:and|or)\s*\}|\\(?:lor|vee)(?![a-zA-Z]))\s*"
               r"|\s*,?\s+(?:and|or|et|ou|und|oder|и|или)\s+"
               r"|(?<=[)\]])\s*(?:and|or)\s*(?=[(\[])|(?<=[\d)\]}])\s*(?:和|或者|或|と|또는)\s*(?=[-\d(\[\\])", ";", s)
    # ... also glued between tuples (`(2,9)or(9,2)`) and in the other languages of the cues (`2 et 9`, `3 和 5`)
    s = re.sub(r"\s*;[\s;]*", ";", s)  # `x = 1 \quad\text{and}\quad x = 2` is one separator
    s = _SCALED.sub(_scaled, s)  # `4 \text{ million}` is 4000000 (before units: a scale is not a unit)
    # Trailing units in \text{...} after a value: `5.4 \text{ cents}`, `15\mbox{ cm}^2`.
    m = ("\\text" in s or "\\mbox" in s) and _UNIT_TEXT.match(s)
    while m:
        s = m.group(1)
        m = _UNIT_TEXT.match(s)
    for _ in range(4):  # unwrap \text{...}: text is compared as text
        s = re.sub(_TEXTCMD + r"\s*\{([^{}]*)\}", r"\1", s)
    s = _PERCENT_WORD.sub("%", s)  # `5 percent`, `5 \text{ Prozent}`
    s = _number_words(s)
    s = re.sub(r"(?<=[\d}])\s*" + _UNITS + r"(?:\^\{?[23]\}?)?\s*\.?$", "", s)
    m = s[:1] in "+-.0123456789\\" and (_OBJECT.match(s) if s.isascii() else _OBJECT_ABROAD.match(s))
    s = m.group(1) if m else s  # `8 apples`, `12 Äpfel`, `3 千克`; not `2 thousandths`, `2 Drittel`, `5万`
    s = re.sub(r"\\mathbb\s*\{?R\}?|(?i:all real numbers)", r"(-\\infty,\\infty)", s)
    s = re.sub(r"\\le(?:qq|q|qslant)?(?![a-zA-Z])|<=", r"\\le ", s)  # ASCII `<=` as `\le`
    s = re.sub(r"\\ge(?:qq|q|qslant)?(?![a-zA-Z])|>=", r"\\ge ", s)
    s = re.sub(r"\\neq?(?![a-zA-Z])|!=", r"\\ne ", s)
    s = re.sub(r"\\lt(?![a-zA-Z])", "<", re.sub(r"\\gt(?![a-zA-Z])", ">", s))
    s = re.sub(r"\\lbrace(?![a-zA-Z])", r"\\{", re.sub(r"\\rbrace(?![a-zA-Z])", r"\\}", s))
    s = re.sub(r"\\langle(?![a-zA-Z])", "(", re.sub(r"\\rangle(?![a-zA-Z])", ")", s))
    s = re.sub(r"\\[lr]?vert(?![a-zA-Z])|\\mid(?![a-zA-Z])", "|", s)
    s = re.sub(r"\\[lc]?dots[bc]?(?![a-zA-Z])|\\ldots", "...", s)
    s = re.sub(r"\\varnothing(?![a-zA-Z])|\\\{\s*\\\}|\\empty(?:set)?(?![a-zA-Z])", r"\\emptyset", s)
    s = re.sub(r"(^|[(\[,])\s*\+\s*\\infty", r"\1\\infty", s)  # `(2, +\infty)`
    s = re.sub(r"\\infinity|(?<![a-zA-Z\\])infinity|(?<![a-zA-Z\\])infty", r"\\infty", s)
    if "matrix" not in s and "array" not in s:
        s = s.replace(_ROW, " ")
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"^[=:]\s*", "", s)
    s = re.sub(r"(?<!\.)\.$|[,;]$", "", s).strip()  # a sentence's period, never an ellipsis
    return s


def squash(s: str) -> str:
    """Remove spaces, except the one that ends a command before a letter (`\\pi r`)."""
    return re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])|\s+", lambda m: m.group(1) + " " if m.group(1) else "", s)


# ---------------------------------------------------------------------------------------
# 3. Structure: lists, sets, tuples, intervals, matrices, relations (plain Python)
# ---------------------------------------------------------------------------------------

_OPEN, _CLOSE = "([{", ")]}"
_REL = re.compile(r"\\le |\\ge |\\ne |\\le$|\\ge$|<|>|=")
_NAME = re.compile(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?[a-zA-Z0-9]+\}?)?(?:\([a-zA-Z]\)|\(-?\d+\))?")


def _depth(s: str) -> int:
    d = best = 0
    for c in s:
        d += (c in _OPEN) - (c in _CLOSE)
        best = max(best, d)
    return best


def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside all brackets (`\\{`, `[a,b)` count as brackets)."""
    parts, depth, last, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif depth == 0 and s.startswith(sep, i) and not (sep[-1].isalpha()
                                                          and s[i + len(sep) : i + len(sep) + 1].isalpha()):
            parts.append(s[last:i])
            last = i + len(sep)
            i = last
            continue
        i += 1
    return parts + [s[last:]]


def _wrapped(s: str) -> bool:
    """Does the bracket opened by s[0] close only at s[-1]?"""
    depth = 0
    for i, c in enumerate(s):
        depth += (c in _OPEN) - (c in _CLOSE)
        if depth == 0:
            return i == len(s) - 1
    return False


def _is_name(s: str) -> bool:
    """A variable (`x`, `a_1`, `\\theta`, `f(x)`) or a tuple of them (`(p,q)`)."""
    s = squash(s)
    if s.startswith("(") and s.endswith(")"):
        return all(_NAME.fullmatch(p) for p in s[1:-1].split(","))
    return bool(_NAME.fullmatch(s)) and s not in ("\\pi", "\\infty", "e", "i")


_PTS = r"(?:[A-Z]'*)"  # a point of a figure: `A`, `B'`
_LABEL = re.compile(r"\|(" + _PTS + r"{2,4})\||\\overline\{(" + _PTS + r"{2,4})\}|"  # |PQ|, \overline{PQ}
                    r"(" + _PTS + r"{2,4})|"  # PQ
                    r"m?\\(?:angle|measuredangle) ?\{?(" + _PTS + r"{1,3})\}?|"  # \angle ABC
                    r"\[(" + _PTS + r"{3,6})\]")  # [ABC]


def _label(s: str):
    """What an answer names, canonically, or None: a variable (`x`, `a_n`, `f(x)`, `(p,q)`), a
    segment (`PQ` = `|QP|` = `\\overline{PQ}`), an angle (`\\angle ABC`), an area (`[ABC]`),
    or a ratio of those (`\\frac{AM}{MC}`, `AM/MC`, `S_1 : S_2`)."""
    s = squash(s)
    if _is_name(s):
        return s
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}|([^/:]+)/([^/:]+)", s)
    parts = [g for g in m.groups() if g] if m else s.split(":")
    if len(parts) > 1:
        atoms = [_label_atom(p) for p in parts]
        return None if None in atoms else ":".join(atoms)
    return _label_atom(s)


def _label_atom(s: str):
    if _NAME.fullmatch(s) and _is_name(s):
        return s
    m = _LABEL.fullmatch(s)
    if not m:
        return None
    seg = m.group(1) or m.group(2) or m.group(3)
    if seg:  # a segment has no direction: PQ = QP
        pts = re.findall(_PTS, seg)
        return "".join(sorted(pts)) if len(pts) == 2 else seg
    if m.group(4):
        pts = re.findall(_PTS, m.group(4))
        return "\\angle " + min("".join(pts), "".join(pts[::-1]))
    return "[" + m.group(5) + "]"


def _symbols(s: str) -> set:
    """The letters and Greek names an expression uses (subscripts and function arguments of a
    label are not its symbols: `a_n = 2n+1` and `f(x) = x^2` state values)."""
    s = re.sub(r"_\{[^{}]*\}|_.|(?<=[a-zA-Z])\([a-zA-Z]\)", "", s)
    s = re.sub(r"\\(?:text|mathrm|operatorname)\{[^{}]*\}", "", s)
    return {t for t in re.findall(r"\\[a-zA-Z]+|[a-zA-Z]", s) if t[0] != "\\" or t[1:] in _GREEK}


def _split_relation(s: str):
    """`a < b \\le c` -> ([a, b, c], ['<', '\\le ']) at the top level."""
    exprs, ops, depth, last, i = [], [], 0, 0, 0
    while i < len(s):
        c = s[i]
        depth += (c in _OPEN) - (c in _CLOSE)
        m = _REL.match(s, i) if depth == 0 else None
        if m:
            exprs.append(s[last:i].strip())
            ops.append(m.group(0).strip())
            i = last = m.end()
            continue
        i += 1
    return exprs + [s[last:].strip()], ops


def _is_constant(s: str) -> bool:
    return not re.search(r"[a-df-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", s))


def _relation(s: str):
    exprs, ops = _split_relation(s)
    if not ops or any(not e for e in exprs):
        return None
    if all(o == "=" for o in ops):
        # An assignment `x = 5` (or `x = 2 + 3 = 5`: the last value counts) states the value;
        # any other equation is compared as an equation.
        # The name may be a label (`PQ = 3`, `\frac{AM}{MC} = 2`) whose value holds none of its
        # own symbols; `x = 2x - 3` is an equation, and so is `AB = CD` (a figure's parts).
        for name, values in ((exprs[0], exprs[1:]), (exprs[-1], exprs[:-1]) if len(exprs) == 2 else (None, None)):
            label = _label(name) if name is not None else None
            if label is not None and not _is_name(name) and any(re.search(r"[A-Z]", re.sub(r"\\[a-zA-Z]+", "", v))
                                                                for v in values):
                continue
            if label is not None and not any(_symbols(name) & _symbols(v) for v in values):
                value = _parse(values[-1])
                names = label[1:-1].split(",") if label.startswith("(") else []
                if value and value[0] == "seq" and value[1] == "(" and len(names) == len(value[3]):
                    return ("record", [("assign", n, v) for n, v in zip(names, value[3])])  # `(x,y) = (1,2)`
                return ("assign", label, value)
        return ("eq", exprs[0], exprs[-1])
    if "=" in ops or "\\ne" in ops and len(ops) > 1:
        return None
    if ops[0] in (">", "\\ge") and all(o in (">", "\\ge") for o in ops):  # write every chain with <
        exprs, ops = exprs[::-1], ["<" if o == ">" else "\\le" for o in ops[::-1]]
    if not all(o in ("<", "\\le") for o in ops) and ops != ["\\ne"]:
        return None
    if ops != ["\\ne"]:
        bounded = _abs_intervals(exprs, ops)
        if bounded is not None:
            return bounded
    # A one-variable inequality is the interval it describes: `-2 \le x < 7` is `[-2, 7)`.
    names = [i for i, e in enumerate(exprs) if _is_name(e)]
    if ops == ["\\ne"] and len(names) == 1 and _is_constant(exprs[1 - names[0]]):  # `x \ne 2`: all reals but 2
        c = ("leaf", exprs[1 - names[0]])
        return ("union", [("seq", "(", ")", [("leaf", "-\\infty"), c]), ("seq", "(", ")", [c, ("leaf", "\\infty")])])
    if ops != ["\\ne"] and len(names) == 1 and all(_is_constant(e) for i, e in enumerate(exprs) if i != names[0]):
        k = names[0]
        lo = ("leaf", exprs[k - 1]) if k > 0 else ("leaf", "-\\infty")
        hi = ("leaf", exprs[k + 1]) if k + 1 < len(exprs) else ("leaf", "\\infty")
        left = "[" if k > 0 and ops[k - 1] == "\\le" else "("
        right = "]" if k + 1 < len(exprs) and ops[k] == "\\le" else ")"
        if len(exprs) <= 3:  # the relation rides along, for comparing with `-x > -1`
            return ("seq", left, right, [lo, hi], ("rel", exprs, ops))
    return ("rel", exprs, ops)


def _abs_intervals(exprs: list, ops: list):
    """A bound on the distance of a real variable from a constant is the set it describes:
    `2 \\le |x| \\le 5` is `[-5, -2] \\cup [2, 5]`, `|x - 1| < 3` is `(-2, 4)`, `|x| > 1` is
    `(-\\infty, -1) \\cup (1, \\infty)`. `exprs` and `ops` are a chain written with `<` and `\\le`.
    None when the chain is not of that form or its bounds have no known sign."""
    ks = [i for i, e in enumerate(exprs) if re.fullmatch(r"\|[^|]+\|", squash(e))]
    if len(ks) != 1 or len(exprs) > 3 or not all(_is_constant(e) for i, e in enumerate(exprs) if i != ks[0]):
        return None
    k = ks[0]
    m = re.fullmatch(r"(.+?)(?:([+-])(.+))?", squash(exprs[k])[1:-1])
    if not _is_name(m.group(1)) or m.group(1).startswith("(") or (m.group(3) and not _is_constant(m.group(3))):
        return None
    center = ("-" if m.group(2) == "+" else "") + m.group(3) if m.group(3) else "0"  # |x + 1| is the distance from -1
    lo = (exprs[k - 1], ops[k - 1] == "<") if k > 0 else None  # (bound, open)
    hi = (exprs[k + 1], ops[k] == "<") if k + 1 < len(exprs) else ("\\infty", True)
    vlo, vhi = _value(lo[0]) if lo else 0.0, math.inf if hi[0] == "\\infty" else _value(hi[0])
    if vlo is None or vhi is None:
        return None
    if lo and (vlo < 0 or (vlo == 0 and not lo[1])):
        lo = None  # a distance is never negative: no lower bound
    if vhi < 0 or (vhi == 0 and hi[1]) or (lo and vlo >= vhi):
        return None  # an empty set or a point: left as the relation
    o = {True: "()", False: "[]"}
    if lo is None:
        return ("seq", o[hi[1]][0], o[hi[1]][1], [_moved(center, "-", hi[0]), _moved(center, "+", hi[0])])
    return ("union", [("seq", o[hi[1]][0], o[lo[1]][1], [_moved(center, "-", hi[0]), _moved(center, "-", lo[0])]),
                      ("seq", o[lo[1]][0], o[hi[1]][1], [_moved(center, "+", lo[0]), _moved(center, "+", hi[0])])])


def _moved(center: str, sign: str, d: str):
    """The leaf `center ± d`, exact when both are plain numbers (`\\infty` stays infinite)."""
    if d == "\\infty":
        return ("leaf", "\\infty" if sign == "+" else "-\\infty")
    c, x = _number(squash(center)), _number(squash(d))
    if c and x and not c[2] and not x[2]:
        return ("leaf", _tex(c[0] + x[0] if sign == "+" else c[0] - x[0]))
    return ("leaf", f"{center}{sign}({d})")


def _value(s: str):
    """The float value of a constant expression, when cheap to know, else None."""
    try:
        t = _Tex(squash(s))
        v = t.expr()[2]
        return v if t.peek() is None else None
    except (_Refuse, IndexError, RecursionError, ValueError, OverflowError, TypeError):
        return None


def _expand_pm(s: str):
    """`1 \\pm \\sqrt{19}` is the set of both roots (so one root alone is not equal)."""
    n = len(re.findall(r"\\(?:pm|mp)(?![a-zA-Z])", s))
    if n == 0 or n > 2:
        return None
    outs = [s]
    for _ in range(n):
        outs = [re.sub(r"\\(?:pm|mp)(?![a-zA-Z])", sign, o, count=1) for o in outs for sign in ("+", "-")]
    return ("set", [("leaf", o) for o in dict.fromkeys(outs)], "pm")


def _items(parts: list[str]) -> list:
    """Parsed list items; a `\\pm` item contributes both of its values."""
    out = []
    for p in parts:
        node = _parse(p)
        out += node[1] if node and node[0] == "set" and node[2] == "pm" else [node]
    return out


_MATRIX = re.compile(r"\\begin\{([pbBvV]?matrix)\}(.*?)\\end\{\1\}", re.S)
_PH = "\ue001"  # stands for the k-th matrix literal of an expression


def _matrix_expr(s: str):
    """A sum / product of matrix literals and constant scalars (`2A + B`, `AB`), evaluated:
    entries exactly with Fraction where they are plain numbers, else as LaTeX for sympy."""
    mats = []
    for m in _MATRIX.finditer(s):
        rows = [[c.strip() for c in _split_top(r, "&")] for r in m.group(2).split(_ROW) if r.strip()]
        if not rows or len({len(r) for r in rows}) != 1 or sum(map(len, rows)) > MAX_ITEMS * 4:
            return None
        mats.append([[_entry(c) for c in r] for r in rows])
    if not 0 < len(mats) <= 4:
        return None
    k = iter(range(len(mats)))
    e = _MATRIX.sub(lambda m: f"{_PH}{next(k)}", s)
    e = re.sub(r"\(\s*(" + _PH + r"\d)\s*\)", r"\1", e).replace("\\cdot", " ").replace("\\times", " ")
    # A small power is a product: `A^2` is `A A` (and `(A)^{3}` is `A A A`).
    e = re.sub("(" + _PH + r"\d)\s*\^\s*\{?\s*([1-5])\s*\}?", lambda m: " ".join([m.group(1)] * int(m.group(2))), e)
    total, terms, sign = None, [], "+"
    for t in re.split(r"([+-])", e):
        if t in ("+", "-"):
            sign = "+" if (sign == "-") == (t == "-") else "-"
        elif t.strip():
            terms.append((sign, t))
            sign = "+"
    if sign == "-" or not e.strip() or e.strip()[-1] in "+-":
        return None
    for sign, term in terms:
        bits = re.split("(" + _PH + r"\d)", term)
        scalar = " ".join(b for b in bits[::2] if b.strip()).strip()
        if re.search(r"[\^_]|\\begin|&", scalar) or (scalar and not _is_constant(scalar)):
            return None
        prod = None
        for b in bits[1::2]:
            m = mats[int(b[1:])]
            if prod is not None and len(prod[0]) != len(m):
                return None
            prod = m if prod is None else [[_add_all([_mul(r[t], m[t][j]) for t in range(len(m))])
                                            for j in range(len(m[0]))] for r in prod]
        if prod is None:
            return None
        factor = _entry(scalar) if scalar else Fraction(1)
        factor = _mul(Fraction(-1), factor) if sign == "-" else factor
        prod = [[_mul(factor, x) for x in r] for r in prod]
        if total is not None and [len(r) for r in total] != [len(r) for r in prod]:
            return None
        total = prod if total is None else [[_add_all([x, y]) for x, y in zip(r, q)] for r, q in zip(total, prod)]
    if total is None:
        return None
    return ("matrix", [[("leaf", _tex(x)) for x in r] for r in total])


def _entry(c: str):
    n = _number(squash(c))
    return n[0] if n and not n[2] and not n[1] else c  # exact numbers as Fraction (a decimal stays as written)


def _tex(x) -> str:
    if not isinstance(x, Fraction):
        return x
    sign, x = ("-" if x < 0 else ""), abs(x)
    return sign + (str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}")


def _mul(x, y):
    return x * y if isinstance(x, Fraction) and isinstance(y, Fraction) else f"({_tex(x)})({_tex(y)})"


def _add_all(xs: list):
    if all(isinstance(x, Fraction) for x in xs):
        return sum(xs, Fraction(0))
    return "+".join(f"({_tex(x)})" for x in xs)


def _parse(s: str):
    """Structure of a normalised answer: nested tuples (kind, ...)."""
    s = s.strip()
    if not s:
        return None
    if "\\approx" in s:  # `x = 1/3 \approx 0.33`: the exact value before the approximation
        left, right = s.split("\\approx", 1)
        s = left if left.strip() and not left.strip().endswith("=") and not _is_name(left) else right
        return _parse(s)
    m = re.fullmatch(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*\\in\s*(.+)", s)
    if m:  # `x \in [-2, 7]`
        return _parse(m.group(1))
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", s):  # `1,000`: one number, not a list
        return ("leaf", s.replace(",", ""))
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return ("union", [_parse(p) for p in parts])
    groups = _split_top(s, ";")
    sizes = {len(_split_top(g, ",")) for g in groups}
    if 1 < len(groups) <= MAX_ITEMS and len(sizes) == 1 and sizes.pop() > 1:
        return ("set", [_parse(g) for g in groups], "or")  # `m = 3, n = 1; m = 5, n = 1`: two solutions
    parts = [p for p in _split_top(s.replace(";", ","), ",")]
    if len(parts) > 1:
        if len(parts) > MAX_ITEMS:
            return ("leaf", s)
        items = _items(parts)
        labels = [n[1] for n in items if n and n[0] == "assign"]
        if len(labels) == len(items) and len(set(labels)) == len(labels):
            return ("record", items)  # `PQ = 3, RS = 7`: one value per name, in this order
        # A bare list is a set of solutions; joined by `;`, "or", "and" it says so (see _solutions_equal).
        return ("set", items, "or" if len(groups) > 1 else True)
    rel = _relation(s)
    if rel is not None:
        return rel
    parts = _split_top(s, ":")
    if 1 < len(parts) <= MAX_ITEMS and all(p.strip() and _is_constant(p) for p in parts):
        return ("ratio", [p.strip() for p in parts])  # `5 : 12` (not a time `8:34 p.m.`)
    if len(_MATRIX.findall(s)) > 1 or (_MATRIX.search(s)
                                       and not re.fullmatch(r"[(\[]?\s*" + _MATRIX.pattern + r"\s*[)\]]?", s, re.S)):
        return _matrix_expr(s) or ("leaf", s)
    m = re.fullmatch(r"[(\[]?\s*\\begin\{([pbBvV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}\s*[)\]]?", s, re.S)
    if m:
        rows = [r for r in m.group(2).split(_ROW) if r.strip()]
        table = [[_parse(c) for c in _split_top(r, "&")] for r in rows]
        return ("matrix", table) if table and sum(map(len, table)) <= MAX_ITEMS * 4 else ("leaf", s)
    if s[0] in "([" and s[-1] in ")]" and _wrapped(s):
        items = _split_top(s[1:-1], ",")
        if len(items) == 1:
            return _parse(s[1:-1])
        return ("seq", s[0], s[-1], [_parse(p) for p in items])
    if s.startswith("\\{") and s.endswith("\\}") and _wrapped(s[1:]):
        return ("set", _items([p for p in _split_top(s[2:-2], ",") if p.strip()]), False)
    if s[0] == "{" and s[-1] == "}" and _wrapped(s):  # a bare TeX group
        return _parse(s[1:-1])
    return _expand_pm(s) or ("leaf", s)


# ---------------------------------------------------------------------------------------
# 4. Plain numbers: exact, in Python (the fast path)
# ---------------------------------------------------------------------------------------

_DEC = r"(?:\d+\.\d*|\.\d+)"
_FRAC = re.compile(r"\\frac(?:\{(\d+)\}|(\d))(?:\{(\d+)\}|(\d))")


def _unsigned(s: str):
    """(value, written_as_decimal) of an unsigned plain number, or None."""
    if s.isdigit():
        return Fraction(int(s)), False
    if re.fullmatch(_DEC, s):
        return Fraction(s), True
    m = re.fullmatch(r"(\d*)\.(\d*)\\overline\{?(\d+)\}?", s)
    if m:  # a repeating decimal 0.1\overline{6} = 1/6: exact, not an approximation
        head, rep = m.group(1) + m.group(2), m.group(3)
        scale = 10 ** len(m.group(2))
        return (Fraction(int(head or 0)) + Fraction(int(rep), 10 ** len(rep) - 1)) / scale, False
    m = re.fullmatch(r"(\d*)" + _FRAC.pattern, s) or re.fullmatch(r"()(\d+)/(\d+)()()", s)
    if m:  # a fraction, or a mixed number `7\frac{3}{4}` = 7 + 3/4
        whole, num, den = m.group(1), m.group(2) or m.group(3), m.group(4) or m.group(5)
        if int(den) == 0 or (whole and not m.group(0).startswith(whole + "\\frac")):
            return None
        return int(whole or 0) + Fraction(int(num), int(den)), False
    m = re.fullmatch(r"(\d+|" + _DEC + r")(?:(?:\\times|\\cdot|\*)10\^\{?([-+]?\d+)\}?|[eE]([-+]?\d+))", s)
    if m:  # scientific notation
        exp = int(m.group(2) or m.group(3))
        if abs(exp) <= 400:
            return Fraction(m.group(1)) * Fraction(10) ** exp, "." in m.group(1)
    return None


def _number(s: str):
    """(value, decimal?, percent?) of a squashed plain-number string, or None."""
    pct = s.endswith("%")
    s = s[:-1] if pct else s
    sign = -1 if s.startswith("-") else 1
    s = s.lstrip("+-") if s[:1] in "+-" and s[1:2] not in "+-" else s
    try:
        got = _unsigned(s)
    except (ValueError, ZeroDivisionError):  # e.g. ints longer than Python's digit limit
        return None
    return None if got is None else (sign * got[0], got[1], pct)


def _terminates(x: Fraction) -> bool:
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _rounds_to(dec: Fraction, exact: Fraction) -> bool:
    """A decimal stands for a value without a finite decimal expansion (1/3, pi) when it
    agrees to 6 decimal places; a value the decimal could have written exactly must be
    written exactly (3.2 is not 3.21, 4.9999999 is not 5)."""
    err = abs(dec - exact)
    return not _terminates(exact) and err <= Fraction(5, 10**7) and err <= abs(exact) / 10**4


def _numbers_equal(a, b) -> bool:
    """Exact comparison; `50\\%` may also mean 0.5 (and `10\\%` vs `10` is the same answer)."""
    (va, da, pa), (vb, db, pb) = a, b
    for x in ([va, va / 100] if pa else [va]):
        for y in ([vb, vb / 100] if pb else [vb]):
            if x == y or (da and _rounds_to(x, y)) or (db and _rounds_to(y, x)):
                return True
    return False


# ---------------------------------------------------------------------------------------
# 5. LaTeX -> sympy code (a small recursive-descent translator)
# ---------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|\d+\.?\d*|\.\d+|[a-zA-Z]|\S")
_FUNCS = {"sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
          "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
          "tanh": "tanh", "ln": "log", "log": "log", "exp": "exp"}
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi "
             "rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split())
_WRAPPERS = {"mathrm", "mathbf", "mathit", "text", "boldsymbol", "operatorname", "mbox", "textbf"}
_ATOM_CMDS = ({"frac", "sqrt", "binom", "pi", "infty", "lfloor", "lceil", "sum", "prod"}
              | set(_FUNCS) | _GREEK | _WRAPPERS)
MAX_EXPONENT = 10_000  # |numeric exponent| allowed
MAX_DIGITS = 100_000  # rough bound on the digits of any constant sub-expression


class _Refuse(Exception):
    """The string is not an expression this checker evaluates (or it is too big)."""


class _Tex:
    """Translate one LaTeX expression into Python code over sympy names.

    Every method returns (code, digits, value): `digits` bounds the size of a constant
    sub-expression (None when it has symbols) and `value` is its float value when cheap.
    They let `^` refuse `10^{10^{10}}` or `(10^{999})^{999}` before sympy computes them."""

    def __init__(self, s: str):
        self.t, self.i, self.abs, self.decimal = _TOKEN.findall(s), 0, 0, False
        self.bound = []  # the indices of the sums and products being read (`i` is then no constant)

    def peek(self, k: int = 0):
        return self.t[self.i + k] if self.i + k < len(self.t) else None

    def take(self, want: str | None = None):
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise _Refuse(tok)
        self.i += 1
        return tok

    def run(self) -> str:
        code = self.expr()[0]
        if self.peek() is not None:
            raise _Refuse(self.peek())
        return code

    def expr(self):
        a = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            b = self.term()
            a = (f"{a[0]}{op}{b[0]}", _grow(a[1], b[1]),
                 _num(a[2], b[2], (lambda x, y: x + y) if op == "+" else (lambda x, y: x - y)))
        return a

    def term(self, arg: bool = False):
        a = self.power() if arg else self.unary()
        while True:
            tok = self.peek()
            if not arg and tok in ("*", "\\cdot", "\\times", "/", "\\div"):
                op = "/" if self.take() in ("/", "\\div") else "*"
                b = self.unary()
            elif self.starts_atom(tok) and not (arg and tok[1:] in _FUNCS):
                if tok[0].isdigit() and self.t[self.i - 1][0].isdigit():
                    raise _Refuse("juxtaposed numbers")  # `0 2` is not 0*2 (a lost separator)
                op, b = "*", self.power()
            else:
                return a
            f = (lambda x, y: x / y) if op == "/" else (lambda x, y: x * y)
            a = (f"{a[0]}{op}{b[0]}", _grow(a[1], b[1]), _num(a[2], b[2], f))

    def starts_atom(self, tok) -> bool:
        if tok is None:
            return False
        if tok[0] == "\\":
            return tok[1:] in _ATOM_CMDS
        return tok[0].isalnum() or tok[0] == "." or tok in ("(", "{", "[") or (tok == "|" and self.abs == 0)

    def unary(self):
        if self.peek() in ("-", "+"):
            sign = self.take()
            a = self.unary()
            return (f"({sign}{a[0]})", a[1], None if a[2] is None else (-a[2] if sign == "-" else a[2]))
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() != "^":
            return base
        self.take()
        exp = self.group() if self.peek() == "{" else (self.unary() if self.peek() == "-" else self.single())
        return _pow(base, exp)

    def postfix(self):
        a = self.atom()
        while self.peek() in ("!", "%"):
            if self.take() == "%":
                a = (f"({a[0]})/100", a[1], None if a[2] is None else a[2] / 100)
            elif a[2] is not None and not (a[2] == int(a[2]) and 0 <= a[2] <= 1000):
                raise _Refuse("factorial")
            else:
                a = (f"factorial({a[0]})", None if a[2] is None else 3000,
                     None if a[2] is None else math.gamma(min(a[2], 170) + 1))
        return a

    def single(self):
        """One TeX argument token: `\\frac59`, `x^23` read a single digit."""
        tok = self.peek()
        if tok is not None and tok[0].isdigit() and len(tok) > 1:
            self.t[self.i : self.i + 1] = [tok[0], tok[1:]]
        return self.atom()

    def group(self, close: str = "}"):
        self.take({"}": "{", ")": "(", "]": "["}[close])
        a = self.expr()
        self.take(close)
        return (f"({a[0]})",) + a[1:]

    def arg(self):
        return self.group() if self.peek() == "{" else self.single()

    def atom(self):
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return _tex_number(self, tok)
        if tok.isalpha() and len(tok) == 1:
            return _tex_letter(self, tok)
        if tok in ("(", "[", "{"):
            self.i -= 1
            return self.group({"(": ")", "[": "]", "{": "}"}[tok])
        if tok == "|":
            self.abs += 1
            a = self.expr()
            self.take("|")
            self.abs -= 1
            return (f"Abs({a[0]})", a[1], None if a[2] is None else abs(a[2]))
        name = tok[1:]
        if name in _FUNCS:
            return _tex_function(self, name)
        if name in _GREEK:
            return (f"Symbol('{name}')", None, None)
        if name in _WRAPPERS:
            return self.group()
        if name in _TEX_COMMANDS:
            return _TEX_COMMANDS[name](self, name)
        raise _Refuse(tok)


# The atoms of _Tex: each takes the parser (positioned after the atom's first token) and
# returns (code, digits, value) like the parser's methods.

def _tex_number(p: _Tex, tok: str):
    if p.peek() == "_":
        raise _Refuse("base-n number")
    if "." in tok:
        p.decimal = True
        return (f"Rational('{tok}')", len(tok), float(tok))
    return (f"Integer({tok})", len(tok), float(tok) if len(tok) < 300 else math.inf)


def _tex_letter(p: _Tex, name: str):
    """A variable, with a subscript (`a_1`, `b_{i+1}`) as part of its name; `e` and `i` are constants.
    The index of a sum or product being read is named by its depth, in the subscripts too, so that
    renaming it changes nothing (`\\sum_{i=1}^{m} a_{m-i} a_i` = `\\sum_{j=1}^{m} a_j a_{m-j}`)."""
    if p.peek() == "_":
        p.take()
        sub = p.take()
        if sub == "{":
            sub = ""
            while p.peek() not in ("}", None):
                sub += p.take()
            p.take("}")
        if not re.fullmatch(r"[A-Za-z0-9+\-]{1,12}", sub):
            raise _Refuse("subscript")
        sub = re.sub(r"[A-Za-z]", lambda m: _bound_name(p, m.group(0)), sub)
        return (f"Symbol('{name}_{sub}')", None, None)
    if name in p.bound:
        return (f"Symbol('{_bound_name(p, name)}')", None, None)
    if name == "e":
        return ("E", 1, math.e)
    if name == "i":
        return ("I", None, None)
    return (f"Symbol('{name}')", None, None)


def _bound_name(p: _Tex, name: str) -> str:
    """`#k` for the index of the k-th enclosing sum or product (the innermost one that binds `name`)."""
    return f"#{len(p.bound) - 1 - p.bound[::-1].index(name)}" if name in p.bound else name


def _tex_frac(p: _Tex, _name: str):
    a, b = p.arg(), p.arg()
    return (f"({a[0]})/({b[0]})", _grow(a[1], b[1]), _num(a[2], b[2], lambda x, y: x / y))


def _tex_sqrt(p: _Tex, _name: str):
    if p.peek() == "[":
        n = p.group("]")
        a = p.arg()
        return (f"root({a[0]},{n[0]})", a[1], None)
    a = p.arg()
    return (f"sqrt({a[0]})", a[1], None if a[2] is None or a[2] < 0 else math.sqrt(a[2]))


def _tex_binom(p: _Tex, _name: str):
    a, b = p.arg(), p.arg()
    if (a[2] is not None and abs(a[2]) > MAX_EXPONENT) or (b[2] is not None and abs(b[2]) > MAX_EXPONENT):
        raise _Refuse("binomial")
    return (f"binomial({a[0]},{b[0]})", None if a[2] is None else int(abs(a[2])) + 1, None)


def _tex_constant(_p: _Tex, name: str):
    return ("pi", 1, math.pi) if name == "pi" else ("oo", None, None)


def _tex_floor(p: _Tex, name: str):
    a = p.expr()
    p.take("\\rfloor" if name == "lfloor" else "\\rceil")
    return (f"{'floor' if name == 'lfloor' else 'ceiling'}({a[0]})", a[1], None)


def _tex_function(p: _Tex, name: str):
    """`\\sin x`, `\\sin^2 x`, `\\log_2 8`, `\\ln(x)`: the argument is a group or the term that follows."""
    exp = None
    if p.peek() == "^":  # `\sin^2 x`
        p.take()
        exp = p.group() if p.peek() == "{" else p.single()
    base = None
    if name == "log" and p.peek() == "_":
        p.take()
        base = p.arg()
    a = p.group(")") if p.peek() == "(" else p.term(arg=True)
    code = f"{_FUNCS[name]}({a[0]}{',' + base[0] if base else ''})"
    out = (code, None if a[1] is None else 1, None)
    return _pow(out, exp) if exp else out


def _tex_bigop(p: _Tex, name: str):
    """`\\prod_{i=1}^{n} a_i b_{i+1}`: sympy's unevaluated Sum / Product over the index. Its body
    is the product that follows; `a_i` is a name, not a function of `i`, so the worker compares these
    only as written, up to the order of terms and factors (see _worker_compare)."""
    p.take("_")
    p.take("{")
    var = p.take()
    if not (len(var) == 1 and var.isalpha()):
        raise _Refuse("index")
    p.take("=")
    lo = p.expr()
    p.take("}")
    p.take("^")
    hi = p.group() if p.peek() == "{" else p.single()
    p.bound.append(var)
    index = _bound_name(p, var)
    body = p.term()  # `\\prod a_i \\cdot b_i` multiplies inside; `+` ends the body
    p.bound.pop()
    return (f"{'Sum' if name == 'sum' else 'Product'}({body[0]},(Symbol('{index}'),{lo[0]},{hi[0]}))", None, None)


_TEX_COMMANDS = {"frac": _tex_frac, "sqrt": _tex_sqrt, "binom": _tex_binom,
                 "pi": _tex_constant, "infty": _tex_constant,
                 "lfloor": _tex_floor, "lceil": _tex_floor, "sum": _tex_bigop, "prod": _tex_bigop}


def _grow(a, b):
    return None if a is None or b is None else a + b + 1


def _num(x, y, f):
    try:
        return None if x is None or y is None else float(f(x, y))
    except (ArithmeticError, ValueError, TypeError):
        return None


def _pow(base, exp):
    """`base**exp`, refused when it would be astronomically large."""
    digits, value = None, None
    if exp[2] is not None:
        if not abs(exp[2]) <= MAX_EXPONENT:
            raise _Refuse("exponent")
        if base[1] is not None:
            digits = base[1] * max(1.0, abs(exp[2]))
            if digits > MAX_DIGITS:
                raise _Refuse("too large")
        value = _num(base[2], exp[2], lambda x, y: x**y if abs(y) < 1000 else math.inf)
    elif exp[1] is not None or base[1] is not None:
        # A symbolic exponent over a number, or an exponent we could not bound: leave it to
        # sympy only when both stay symbolic; a constant tower with an unknown size is refused.
        if exp[1] is not None and base[1] is not None:
            raise _Refuse("tower")
    return (f"({base[0]})**({exp[0]})", digits, value if isinstance(value, float) and value == value else None)


def to_code(s: str):
    """(python code, contains a decimal literal) for a leaf, or None when not translatable."""
    try:
        tex = _Tex(squash(s))
        code = tex.run()
        return code, tex.decimal
    except (_Refuse, IndexError, RecursionError, ValueError, OverflowError, TypeError):
        return None


# ---------------------------------------------------------------------------------------
# 6. Comparison
# ---------------------------------------------------------------------------------------

def _text_value(s: str):
    """Text answers compare case-insensitively: `\\text{Evelyn}` = `evelyn`, `\\text{(C)}` = `C`."""
    m = re.fullmatch(r"\(?([A-E])\)?|\(([A-Ea-e])\)(?: .*)?", s)
    if m:  # a multiple-choice letter
        return "choice:" + (m.group(1) or m.group(2)).upper()
    words = re.findall(r"[A-Za-z]+", s)
    if re.fullmatch(r"[A-Za-z][A-Za-z' \-]*", s) and (all(len(w) > 2 for w in words) or s.lower() in ("no", "ok")):
        return " ".join(s.lower().split())  # words; `p - q` and `xy` stay math
    return None


def _leaf_equal(x: str, y: str, ctx) -> bool:
    sx, sy = squash(x), squash(y)
    if sx == sy:
        return True
    tx, ty = _text_value(x), _text_value(y)
    if tx is not None or ty is not None:
        return tx == ty
    bx, by = re.fullmatch(r"(\d+)_\{?(\d+)\}?", sx), re.fullmatch(r"(\d+)_\{?(\d+)\}?", sy)
    if bx or by:  # base-n numerals: `52_8` (the subscript may be omitted by the answer)
        dx, dy = (bx.group(1) if bx else sx), (by.group(1) if by else sy)
        return dx == dy and (not bx or not by or bx.group(2) == by.group(2))
    nx, ny = _number(sx), _number(sy)
    if nx and ny:
        return _numbers_equal(nx, ny)
    if len(sx) > MAX_ANSWER or len(sy) > MAX_ANSWER or max(_depth(sx), _depth(sy)) > MAX_DEPTH:
        return False
    if sx.endswith("%") != sy.endswith("%"):  # `10\%` answered as `\frac{1}{10}` or as `10`
        px, py = (sx[:-1], sy) if sx.endswith("%") else (sx, sy[:-1])
        if px.endswith("%") or py.endswith("%"):
            return False
        return _leaf_equal(px, py, ctx) or _sympy_equal("expr", f"({px})/100", py, ctx)
    return _sympy_equal("expr", sx, sy, ctx)


def _sympy_equal(mode: str, x: str, y: str, ctx) -> bool:
    cx, cy = to_code(x), to_code(y)
    if cx is None or cy is None:
        return False
    # Only a bare decimal (`3.141593`) may stand for an irrational value to 6 places; an
    # expression that merely contains a decimal (`0.5\sqrt{2}`) is exact.
    bare = [re.fullmatch(r"[-+]?(?:\d+\.\d*|\.\d+)", squash(v)) is not None for v in (x, y)]
    return _ask(mode, cx[0], cy[0], mode == "expr" and bare[0] != bare[1], ctx)


def _diff(node) -> tuple[str, str] | None:
    """An equation as the expression `lhs - (rhs)` (LaTeX), for proportionality tests."""
    if node[0] == "eq":
        return f"{node[1]}-({node[2]})"
    if node[0] == "assign" and node[2] and node[2][0] == "leaf" and "(" not in node[1][:1]:
        return f"{node[1]}-({node[2][1]})"
    return None


def _as_intervals(node):
    if node[0] == "union":
        return node[1]
    if node[0] == "set" and node[2] and all(n and n[0] == "seq" and len(n[3]) == 2 for n in node[1]):
        return node[1]  # `x < -1 or x > 2` written as a list of intervals
    if node[0] == "seq" and len(node[3]) == 2:
        return [node]
    return None


def _unordered(xs, ys, ctx) -> bool:
    """Multiset equality; greedy matching is exact because equality is transitive."""
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:
        for j, y in enumerate(left):
            if _equal(x, y, ctx):
                del left[j]
                break
        else:
            return False
    return True


def _record_equal(r, o, ctx) -> bool:
    """Named values (`PQ = 3, RS = 7`): against other names, name by name; against bare values
    (`3, 7` or `(3, 7)`), in order (an item that names something must name the same thing)."""
    if o[0] == "record":
        mine, theirs = dict((n[1], n) for n in r[1]), dict((n[1], n) for n in o[1])
        return mine.keys() == theirs.keys() and all(_equal(mine[k], theirs[k], ctx) for k in mine)
    items = o[1] if o[0] == "set" and o[2] in (True, "or") else o[3] if o[0] == "seq" and o[1] == "(" else None
    return items is not None and len(items) == len(r[1]) and all(_equal(x, y, ctx) for x, y in zip(r[1], items))


def _indexed(r) -> bool:
    """Do a record's labels number one name (`x_1`, `x_2`, `x_{3}`)?"""
    bases = {re.sub(r"_\{?\d+\}?$", "", n[1]) for n in r[1] if re.search(r"_\{?\d+\}?$", n[1])}
    return len(bases) == 1 and all(re.search(r"_\{?\d+\}?$", n[1]) for n in r[1])


def _solutions_equal(a, g, ctx) -> bool:
    """A gold that lists every solution (a set `\\{..\\}`, `\\pm`, several tuples, or values joined
    by `;`, "or", "and") is met by the same solutions with one repeated (`2, 1, 1` = `1 \\text{ or }
    2`), or numbered (`x_1 = 2, x_2 = 1`). A gold that repeats a value counts multiplicities (the
    response's distinct values never equal it). A gold list joined by commas alone may be a
    sequence (`a_1, a_2`): it keeps its count and its numbering."""
    if not (a and g and g[0] == "set" and a[0] in ("set", "record")):
        return False
    items = g[1]
    tuples = g[2] is True and all(n and n[0] == "seq" and n[1] == "(" for n in items)
    if not (g[2] in (False, "or", "pm") or tuples):
        return False
    numbered = a[0] == "record" and _indexed(a)
    mine = [n[2] for n in a[1]] if numbered else a[1] if a[0] == "set" else []
    once = []
    for x in mine:
        if not any(_equal(x, y, ctx) for y in once):
            once.append(x)
    return (numbered or len(once) < len(mine)) and _unordered(once, items, ctx)


def _clock(parts: list) -> bool:
    """`9:24`, `4:30:05`: hours then two-digit minutes (and seconds) under 60."""
    return (bool(re.fullmatch(r"\d{1,2}", parts[0])) and all(re.fullmatch(r"[0-5]\d", p) for p in parts[1:3])
            and len(parts) <= 3)


def _ratio_equal(r, o, ctx) -> bool:
    """`a : b` equals a proportional ratio (`2:4` = `1:2`), and a two-term ratio equals its
    value (`2:3` = `\\frac23`), never its reciprocal. A ratio that reads as a clock time
    (`9:24`, `4:30`) is compared term by term: `3:8` or `2:15` is a different time."""
    if o[0] == "ratio":
        if len(o[1]) != len(r[1]):
            return False
        nums = [_number(squash(p)) for p in r[1] + o[1]]
        if all(n and not n[2] for n in nums):  # plain numbers: exact, in Python
            vals = [n[0] for n in nums]
            if 0 in vals or _clock(r[1]) or _clock(o[1]):
                return vals[: len(r[1])] == vals[len(r[1]) :]
            return all(x / vals[0] == y / vals[len(r[1])] for x, y in zip(vals[1 : len(r[1])], vals[len(r[1]) + 1 :]))
        return all(_leaf_equal(f"\\frac{{{x}}}{{{r[1][0]}}}", f"\\frac{{{y}}}{{{o[1][0]}}}", ctx)
                   for x, y in zip(r[1][1:], o[1][1:]))
    if o[0] == "leaf" and len(r[1]) == 2:
        x, y = r[1]
        nx, ny = _number(squash(x)), _number(squash(y))
        if nx and ny and not nx[2] and not ny[2]:  # plain numbers: the exact quotient
            return ny[0] != 0 and _leaf_equal(_tex(nx[0] / ny[0]), o[1], ctx)
        return _leaf_equal(f"\\frac{{{x}}}{{{y}}}", o[1], ctx)
    return False


def _equal(a, b, ctx) -> bool:
    if a is None or b is None:
        return False
    ka, kb = a[0], b[0]
    if ka == "record" or kb == "record":
        return _record_equal(a, b, ctx) if ka == "record" else _record_equal(b, a, ctx)
    if ka == "assign" and kb == "assign":
        if a[1] != b[1]:  # `x = 1` is not `y = 1`, but `a = b` is `b = a`
            da, db = _diff(a), _diff(b)
            return da is not None and db is not None and _sympy_equal("eq", da, db, ctx)
        return _equal(a[2], b[2], ctx)
    if ka == "eq" or kb == "eq":  # equations: same solution set, `lhs - rhs` up to a factor
        da, db = _diff(a), _diff(b)
        return da is not None and db is not None and _sympy_equal("eq", da, db, ctx)
    if ka == "assign":
        return _equal(a[2], b, ctx)
    if kb == "assign":
        return _equal(a, b[2], ctx)
    if ka == "rel" and kb == "seq" and len(b) > 4:
        return _equal(a, b[4], ctx)
    if kb == "rel" and ka == "seq" and len(a) > 4:
        return _equal(a[4], b, ctx)
    if ka == "rel" and kb == "rel":
        if a[2] != b[2] or len(a[1]) != len(b[1]):
            return False
        mode = "eq" if a[2] == ["\\ne"] else "rel"
        return all(_sympy_equal(mode, f"{a[1][i + 1]}-({a[1][i]})", f"{b[1][i + 1]}-({b[1][i]})", ctx)
                   for i in range(len(a[2])))
    if ka == "set" and len(a[1]) == 1:
        return _equal(a[1][0], b, ctx)
    if kb == "set" and len(b[1]) == 1:
        return _equal(a, b[1][0], ctx)
    if ka == "leaf" and kb == "leaf":
        return _leaf_equal(a[1], b[1], ctx)
    if ka == "ratio" or kb == "ratio":
        return _ratio_equal(a, b, ctx) if ka == "ratio" else _ratio_equal(b, a, ctx)
    if ka == "union" or kb == "union":
        ia, ib = _as_intervals(a), _as_intervals(b)
        return ia is not None and ib is not None and _unordered(ia, ib, ctx)
    if ka == "seq" and kb == "seq":  # tuples are ordered; interval ends must match
        if len(a[3]) != len(b[3]) or (len(a[3]) == 2 and (a[1], a[2]) != (b[1], b[2])):
            return False
        return all(_equal(x, y, ctx) for x, y in zip(a[3], b[3]))
    if {ka, kb} == {"seq", "set"}:  # `(1, 2)` answered as `1, 2`: compared in order
        s, q = (a, b) if ka == "set" else (b, a)
        return (s[2] in (True, "or") and q[1] == "(" and len(s[1]) == len(q[3])
                and all(_equal(x, y, ctx) for x, y in zip(s[1], q[3])))
    if ka == "set" and kb == "set":  # sets and lists of solutions are unordered
        return _unordered(a[1], b[1], ctx)
    if ka == "matrix" and kb == "matrix":
        return [len(r) for r in a[1]] == [len(r) for r in b[1]] and all(
            _equal(x, y, ctx) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
    if {ka, kb} == {"matrix", "leaf"}:  # a 1x1 product (a row times a column) is its entry
        m, q = (a, b) if ka == "matrix" else (b, a)
        return len(m[1]) == 1 and len(m[1][0]) == 1 and _equal(m[1][0][0], q, ctx)
    if {ka, kb} == {"matrix", "seq"}:  # a column vector written as a tuple
        m, q = (a, b) if ka == "matrix" else (b, a)
        flat = [r[0] for r in m[1] if len(r) == 1]
        return (q[1] == "(" and len(flat) == len(m[1]) == len(q[3])
                and all(_equal(x, y, ctx) for x, y in zip(flat, q[3])))
    return False


def is_equiv(answer: str, gold: str, timeout: float = TIMEOUT) -> bool:
    """Are two answer strings the same mathematical answer? Never raises."""
    return _is_equiv(answer, gold, {"left": timeout})


def _is_equiv(answer: str, gold: str, ctx) -> bool:
    try:
        if not isinstance(answer, str) or not isinstance(gold, str):
            return False
        if max(len(answer), len(gold)) > MAX_ANSWER:  # too big to be an answer: exact match only
            return answer.strip() == gold.strip() != ""
        a, g = normalize(answer), normalize(gold)
        if not a or not g:
            return False
        if squash(a) == squash(g):
            return True
        if max(_depth(a), _depth(g)) > MAX_DEPTH:
            return False  # too deep to parse: only an exact (normalised) match counts
        na, ng = _parse(a), _parse(g)
        return _equal(na, ng, ctx) or _solutions_equal(na, ng, ctx)
    except RecursionError:
        return False
    except Exception:  # noqa: BLE001 - the reward must never crash training
        return False


def verify(response: str, gold: str, strict: bool = False, timeout: float = TIMEOUT) -> bool:
    """Extract the final answer of `response` and compare it with `gold`. Never raises.

    Several boxes: side-by-side boxes are one list (see `extract_answer`); when that list
    is not the gold, it still counts if every box restates the gold (`\\boxed{x+11}, \\boxed{11+x}`).
    A gold that is a list of k > 1 answers may also be given by k boxes with prose between
    them (`\\boxed{(2,4)}` ... `\\boxed{(4,2)}`) when the response boxes nothing else. A single
    gold is only ever judged by the last box (or side-by-side list), so several candidates
    stay wrong."""
    try:
        answer, s, boxed = _extract(response, strict)
        if answer is None:
            return False
        ctx = {"left": timeout}  # one budget for all the comparisons of this response
        if _is_equiv(answer, gold, ctx) or _names_value(answer, gold, ctx):
            return True
        if not boxed:  # a stated final answer outranks the boxes before it
            return False
        group = _box_group(s) or []
        if 1 < len(group) <= MAX_ITEMS and all(_is_equiv(p, gold, ctx) for p in group):
            return True
        return _spread_over_boxes(s, gold, ctx)
    except Exception:  # noqa: BLE001
        return False


def _names_value(answer: str, gold: str, ctx) -> bool:
    """A response that states the value of an expression in names (`m + n = 25`, `a^2+b^2 = 7`,
    `xy = 6`) answers a gold that is that value. One way only: a gold `x + y = 5` is an
    equation (a line), which the value 5 does not answer."""
    try:
        if max(len(answer), len(gold)) > MAX_ANSWER or _depth(gold) > MAX_DEPTH or "=" not in answer:
            return False
        a = normalize(answer)
        exprs, ops = _split_relation(a)
        if len(exprs) != 2 or ops != ["="]:
            return False
        names = re.sub(r"[_^]\{?[a-zA-Z0-9]\}?|\\cdot|[+\-*() ]", " ", exprs[0])
        if not re.fullmatch(r"[a-zA-Z ]+", names) or not _is_constant(exprs[1]) or not exprs[1].strip():
            return False
        g = _parse(normalize(gold))
        return g is not None and g[0] not in ("eq", "assign", "rel", "record") and _is_equiv(exprs[1], gold, ctx)
    except Exception:  # noqa: BLE001
        return False


def _spread_over_boxes(s: str, gold: str, ctx) -> bool:
    """Do the response's boxes, k distinct ones in all, form a gold list of k > 1 answers?
    (A response that also boxes anything else, a candidate or a step, is not read this way.)"""
    if len(gold) > MAX_ANSWER or _depth(gold) > MAX_DEPTH:
        return False
    node = _parse(normalize(gold))
    k = len(node[1]) if node and node[0] in ("set", "record") else 0
    if not 1 < k <= MAX_ITEMS:
        return False
    seen = {}
    for _, _, content in _boxes(s):
        if len(content) > MAX_ANSWER:
            return False  # too big to be one of the answers
        seen.setdefault(squash(normalize(content)), content.strip())
        if len(seen) > k:
            return False
    return len(seen) == k and _is_equiv(", ".join(seen.values()), gold, ctx)


# ---------------------------------------------------------------------------------------
# 7. The sympy worker: a persistent subprocess with a deadline per request
# ---------------------------------------------------------------------------------------
# Why a subprocess: sympy cannot be interrupted from another thread, and signal.alarm only
# works on the main thread of the main interpreter. A subprocess is its own main thread (it
# can use SIGALRM to stop itself, cheaply), and when it does not answer in time the caller
# kills it: nothing it does can hang or exhaust the caller. subprocess (not multiprocessing)
# also works inside daemonic multiprocessing workers.

WORKER = {"proc": None, "buf": b""}
_LOCK = threading.Lock()
VERDICT_CACHE: dict = {}


def _undefined(x, sympy) -> bool:
    """Does `x` hold an undefined or infinite value (`\\ln 0` is zoo, `\\infty - \\infty` nan)? The
    limits of a sum or product may be infinite (`\\sum_{i=1}^{\\infty}`): a series, not a value."""
    if not x.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        return False  # the common case, in one walk
    if x.has(sympy.zoo, sympy.nan) or not x.has(sympy.Sum, sympy.Product):
        return True
    bodies = x.replace(lambda e: isinstance(e, (sympy.Sum, sympy.Product)), lambda e: e.function)
    return bodies.has(sympy.oo, -sympy.oo)


def _worker_compare(mode: str, ca: str, cb: str, approx: bool, ns: dict) -> bool:
    """Runs in the worker. `expr`: the same value; `eq` / `rel`: a = c*b for a constant c != 0
    (c > 0 for inequalities), i.e. the same equation / inequality.

    Values are compared at 50 digits at random points for the free symbols (one point for
    constants): an identity like sec^2 = tan^2 + 1 cancels to nothing sympy can resolve,
    while `f + 10^{-30}` or `sqrt(2)*10^100 + 1` leave a resolved nonzero difference."""
    import mpmath
    import sympy

    a, b = eval(ca, ns), eval(cb, ns)  # noqa: S307 - code comes from _Tex, never from the input
    if any(_undefined(x, sympy) for x in (a, b)):
        # Before any branch compares: `zoo + S + 1` is `zoo + S` to sympy (`\frac{1}{0} + 1` absorbs the 1).
        return False  # undefined or infinite (`\ln 0 + 1`): equal to nothing (`\infty` matches as a string)
    if any(x.has(sympy.Sum, sympy.Product) for x in (a, b)):
        # Over names like `a_i` a sum or product is known only as written: sympy's canonical
        # order of terms and factors, never evaluated (`\sum_{i=1}^n a_i` would "be" `n a_i`).
        return mode == "expr" and a == b
    if mode == "expr" and (a == b or a - b == 0):
        return True
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    if mode == "expr" and not syms and all(p.is_Rational for p in a.as_real_imag() + b.as_real_imag()):
        return False  # exact (complex) rationals that differ: a decimal could write them exactly
    diff = a - b if mode == "expr" else None
    rng, agree, ratio = random.Random(1234), 0, None

    tiny = mpmath.mpf("1e-40")

    def at(e, point, digits=50):
        """(value, resolved, nonzero) at 50 digits, as an mpmath complex (no overflow to inf).
        sympy returns a full-precision Float for a part it resolved, and a 1-bit "0.e-159"
        for a part that cancelled beyond what it could resolve (a zero, in practice)."""
        try:
            parts = e.evalf(digits, subs=point).as_real_imag()
            z = mpmath.mpc(*(mpmath.mpf(sympy.Float(p, 50)._mpf_) for p in parts))
        except (TypeError, ValueError, AttributeError, ZeroDivisionError):
            return None, False, False
        if not mpmath.isfinite(z):
            return None, False, False
        full = [p.is_Float and p._prec >= min(100, 3 * digits) for p in parts]
        resolved = all(f or p == 0 or abs(mpmath.mpf(sympy.Float(p, 50)._mpf_)) <= tiny * abs(z)
                       for f, p in zip(full, parts))
        return z, resolved, any(f and p != 0 for f, p in zip(full, parts))

    with mpmath.workdps(60):
        for _ in range(8 if syms else 1):  # random points away from 0 and small integers
            if agree == 4:
                break
            point = {x: sympy.Float(rng.choice((-1, 1)) * rng.uniform(0.3, 2.2), 50) for x in syms}
            if mode == "expr":
                d, _, nonzero = at(diff, point)
                if d is None:
                    continue
                if nonzero:  # a resolved nonzero difference, however small or large
                    (va, _, _), (vb, _, _) = at(a, point, 15), at(b, point, 15)
                    if va is None or vb is None:
                        continue
                    # a decimal stands for an irrational constant when it agrees to 6 places
                    return not syms and approx and abs(d) <= 5e-7 and abs(d) <= 1e-4 * max(abs(va), abs(vb))
                if d != 0:  # unresolved: a zero only if tiny next to the values themselves
                    (va, _, _), (vb, _, _) = at(a, point, 15), at(b, point, 15)
                    if va is None or vb is None or abs(d) > tiny * max(1, abs(va), abs(vb)):
                        continue  # could not tell at this point
                agree += 1
                continue
            (va, oka, _), (vb, okb, _) = at(a, point), at(b, point)
            if va is None or vb is None or not (oka and okb):
                continue
            if abs(va) < tiny or abs(vb) < tiny:
                if max(abs(va), abs(vb)) > tiny:
                    return False  # one side vanishes where the other does not
                continue
            r = va / vb
            ratio = r if ratio is None else ratio
            if abs(r - ratio) > tiny * abs(ratio) or (mode == "rel" and (abs(r.imag) > tiny or r.real <= 0)):
                return False
            agree += 1
    if agree >= (3 if syms else 1):
        return True
    return mode == "expr" and sympy.simplify(diff) == 0


def _worker_main() -> None:
    """Loop of the worker process: one JSON request per line, one answer per line."""
    import resource  # POSIX only, and needed only here, in the worker process
    import signal

    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    except (ValueError, OSError):
        pass
    import sympy

    names = ("Integer Rational Symbol sqrt root pi E I oo Abs floor ceiling factorial binomial "
             "sin cos tan cot sec csc asin acos atan sinh cosh tanh log exp Sum Product")
    ns = {"__builtins__": {}} | {n: getattr(sympy, n) for n in names.split()}

    class Alarm(BaseException):  # BaseException: sympy's `except Exception` cannot swallow it
        pass

    def on_alarm(*_):
        raise Alarm

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, max(float(req["t"]), 0.001))
            try:
                reply = b"1" if _worker_compare(req["m"], req["a"], req["b"], req["x"], ns) else b"0"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Alarm:
            reply = b"T"
        except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, sympy errors
            reply = b"E"
        out.write(reply + b"\n")
        out.flush()


def _stop_worker() -> None:
    proc, WORKER["proc"], WORKER["buf"] = WORKER["proc"], None, b""
    if proc is not None:
        try:
            proc.kill()
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


def _forget_worker_after_fork() -> None:
    """A forked child must not share its parent's worker (or a lock held at fork time)."""
    global _LOCK
    _LOCK = threading.Lock()
    proc, WORKER["proc"], WORKER["buf"] = WORKER["proc"], None, b""
    if proc is not None:
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()  # closes this child's copies of the pipes only
            except Exception:  # noqa: BLE001
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_after_fork)
atexit.register(_stop_worker)


def _readline(deadline: float):
    fd = WORKER["proc"].stdout.fileno()
    while b"\n" not in WORKER["buf"]:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None  # the worker died
        WORKER["buf"] += chunk
    line, _, WORKER["buf"] = WORKER["buf"].partition(b"\n")
    return line


def _request(payload: dict, ctx):
    """Send one request to the worker (starting it if needed); None on timeout or crash.
    Only the time spent inside the lock counts against the comparison's budget: waiting
    for another thread's request is not this comparison's sympy work."""
    with _LOCK:
        if WORKER["proc"] is None or WORKER["proc"].poll() is not None:
            _stop_worker()
            WORKER["proc"] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
            if _readline(time.monotonic() + 120) != b"ready":  # importing sympy: not timed
                _stop_worker()
                return None
        start = time.monotonic()
        try:
            WORKER["proc"].stdin.write(json.dumps(payload | {"t": ctx["left"]}).encode() + b"\n")
            WORKER["proc"].stdin.flush()
            line = _readline(start + ctx["left"] + 0.5)  # the worker stops itself at t; this is the backstop
        except OSError:
            line = None
        if line is None:  # no answer in time: kill it; the next request starts a fresh one
            _stop_worker()
        ctx["left"] -= time.monotonic() - start
        return line


def _ask(mode: str, ca: str, cb: str, approx: bool, ctx) -> bool:
    key = (mode, ca, cb, approx)
    if key in VERDICT_CACHE:
        return VERDICT_CACHE[key]
    if ctx["left"] <= 0:
        return False
    line = _request({"m": mode, "a": ca, "b": cb, "x": approx}, ctx)
    if line in (b"1", b"0", b"E"):  # timeouts are not cached: they depend on the load
        if len(VERDICT_CACHE) > 50_000:
            VERDICT_CACHE.clear()
        VERDICT_CACHE[key] = line == b"1"
    return line == b"1"


# ---------------------------------------------------------------------------------------
# 8. Command line
# ---------------------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Rule-based math answer checker.")
    p.add_argument("response", nargs="?", help="model response (or an answer)")
    p.add_argument("gold", nargs="?", help="gold answer")
    p.add_argument("--jsonl", help="score a file of {response, answer[, expected]} rows")
    p.add_argument("--strict", action="store_true", help="accept only \\boxed answers")
    p.add_argument("--timeout", type=float, default=TIMEOUT)
    args = p.parse_args(argv)
    if args.jsonl:
        rows = [json.loads(line) for line in open(args.jsonl, encoding="utf-8") if line.strip()]
        verify("\\boxed{x+1}", "1+x")  # start the worker outside the timed loop
        start, right, fp, fn, labelled = time.perf_counter(), 0, 0, 0, 0
        for row in rows:
            got = verify(row["response"], row["answer"], strict=args.strict, timeout=args.timeout)
            if "expected" in row:
                labelled += 1
                right += got == row["expected"]
                fp += got and not row["expected"]
                fn += row["expected"] and not got
            else:
                right += got
        secs = time.perf_counter() - start
        n = labelled or len(rows)
        name = "accuracy" if labelled else "verified"
        print(f"{name}: {right}/{n} = {right / max(n, 1):.4f}"
              + (f"  false positives: {fp}  false negatives: {fn}" if labelled else ""))
        print(f"throughput: {len(rows) / secs:.0f} responses/s ({len(rows)} in {secs:.2f} s)")
        return 0
    if args.response is None or args.gold is None:
        p.print_usage()
        return 2
    print(f"extracted: {extract_answer(args.response, strict=args.strict)}")
    print(f"verdict: {verify(args.response, args.gold, strict=args.strict, timeout=args.timeout)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker_main()
    else:
        sys.exit(_main(sys.argv[1:]))
