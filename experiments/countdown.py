"""The countdown task's checker, for pacs.py's and eval.py's --reward experiments/countdown.py:check.

A countdown row's answer field names the numbers and the target, "countdown: 2 5 8 -> 18"; a right response boxes
an arithmetic expression that uses every given number exactly once (a number given twice, twice) and no other,
and equals the target: \\boxed{(8-5)*6}. check() reads the response's last \\boxed{...} (verify.extract_answer with
strict=True: only boxes count) and parses it by a fixed grammar, in exact Fraction arithmetic, never eval():

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/" | "×" | "÷") factor)*
    factor := INTEGER | "(" expr ")"          INTEGER: 0 or a digit 1-9 then digits (no sign, no leading zero)

Spaces may stand between tokens. Anything else (a unary minus, a decimal point, "=", a second box beside the last,
an expression over MAX_CHARS characters or nested over MAX_DEPTH brackets) is not an answer: False, as are a
division by zero, an expression whose numbers are not the given ones (the target alone, a number twice, an
extra number, none) and a wrong value. A row whose answer is not a countdown one is not this checker's: None (the
caller's default verifier, verify.py, scores it).

canonical(expr) writes an expression's form up to commutativity and associativity of + and *: a chain of + (or of
*) is one list of operands, sorted, so (8-5)*6 and 6*(8-5) are one form, as are 2+(5+8) and 8+5+2; - and / stay
as written, so 8-(5-2) and 8+2-5 are two forms (two ways to compute), as are 6*3 and 6+6+6. Distinct right answers
are counted by it.
"""
import os
import re
import sys
from collections import Counter
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verify import extract_answer  # noqa: E402  (the last box, as verify.py reads it)

PREFIX = "countdown:"
ANSWER = re.compile(r"countdown: (\d+(?: \d+)*) -> (-?\d+)")  # the answer field of a countdown row
TOKEN = re.compile(r"\s*(?:(0|[1-9]\d*)|([-+*/×÷()]))")
OPS = {"×": "*", "÷": "/"}
MAX_CHARS = 200  # a longer expression is not an answer
MAX_DEPTH = 20  # nor one nested deeper


def answer_field(numbers, target):
    """The answer field of a countdown row: answer_field([2, 5, 8], 18) -> 'countdown: 2 5 8 -> 18'."""
    return f"{PREFIX} {' '.join(str(n) for n in numbers)} -> {target}"


def parse_answer(answer):
    """(numbers, target) of a countdown row's answer field, or None for a row of another task; a field that says
    countdown but does not follow the format is a ValueError (the dataset's error, not the response's)."""
    if not isinstance(answer, str) or not answer.startswith(PREFIX):
        return None
    m = ANSWER.fullmatch(answer.strip())
    if not m:
        raise ValueError(f"countdown answer {answer[:60]!r}: expected 'countdown: N N N -> TARGET'")
    return [int(n) for n in m.group(1).split()], int(m.group(2))


def tokens(expr):
    """The expression's tokens, ints and operator characters (× and ÷ as * and /); ValueError where the grammar
    has no token."""
    out, i, text = [], 0, expr.rstrip()
    while i < len(text):
        m = TOKEN.match(text, i)
        if not m:
            raise ValueError(f"not a countdown expression: unexpected {text[i:i + 10]!r}")
        out.append(int(m.group(1)) if m.group(1) else OPS.get(m.group(2), m.group(2)))
        i = m.end()
    return out


def parse(expr):
    """The expression's tree: an int, or (op, left, right) with op in + - * /. ValueError on a string outside the
    grammar, over MAX_CHARS characters, or nested deeper than MAX_DEPTH."""
    if not isinstance(expr, str) or len(expr) > MAX_CHARS:
        raise ValueError(f"not a countdown expression: not a string of at most {MAX_CHARS} characters")
    toks = tokens(expr)
    tree, end = parse_sum(toks, 0, 0)
    if end != len(toks):
        raise ValueError(f"not a countdown expression: {toks[end]!r} where an operator or the end belongs")
    return tree


def parse_sum(toks, i, depth):
    left, i = parse_product(toks, i, depth)
    while i < len(toks) and toks[i] in ("+", "-"):
        right, j = parse_product(toks, i + 1, depth)
        left, i = (toks[i], left, right), j
    return left, i


def parse_product(toks, i, depth):
    left, i = parse_factor(toks, i, depth)
    while i < len(toks) and toks[i] in ("*", "/"):
        right, j = parse_factor(toks, i + 1, depth)
        left, i = (toks[i], left, right), j
    return left, i


def parse_factor(toks, i, depth):
    if i >= len(toks):
        raise ValueError("not a countdown expression: it ends where a number belongs")
    if isinstance(toks[i], int):
        return toks[i], i + 1
    if toks[i] != "(":
        raise ValueError(f"not a countdown expression: {toks[i]!r} where a number belongs")
    if depth >= MAX_DEPTH:
        raise ValueError(f"not a countdown expression: brackets nested deeper than {MAX_DEPTH}")
    inner, i = parse_sum(toks, i + 1, depth + 1)
    if i >= len(toks) or toks[i] != ")":
        raise ValueError("not a countdown expression: a bracket is not closed")
    return inner, i + 1


def numbers_of(tree):
    """The integers the tree uses, in order."""
    return [tree] if isinstance(tree, int) else numbers_of(tree[1]) + numbers_of(tree[2])


def value(tree):
    """The tree's exact value, a Fraction; None where it divides by zero."""
    if isinstance(tree, int):
        return Fraction(tree)
    a, b = value(tree[1]), value(tree[2])
    if a is None or b is None or (tree[0] == "/" and b == 0):
        return None
    if tree[0] == "+":
        return a + b
    if tree[0] == "-":
        return a - b
    return a * b if tree[0] == "*" else a / b


def check(response, answer):
    """True iff the response's last box holds an expression that uses exactly the row's numbers, each as often as
    given, and equals its target; False otherwise (no box, outside the grammar, other numbers, a division by zero);
    None for a row that is not a countdown one."""
    row = parse_answer(answer)
    if row is None:
        return None
    numbers, target = row
    boxed = extract_answer(response, strict=True) if isinstance(response, str) else None
    if boxed is None:
        return False
    try:
        tree = parse(boxed)
    except ValueError:
        return False
    if Counter(numbers_of(tree)) != Counter(numbers):
        return False
    return value(tree) == target


def canonical(expr):
    """The expression's form up to commutativity and associativity of + and * (module docstring): a string, equal
    for (8-5)*6 and 6*(8-5), different for 8-(5-2) and 8+2-5. expr: a string (parsed by the grammar; ValueError
    outside it) or a tree from parse()."""
    return form(parse(expr) if isinstance(expr, str) else expr)


def form(tree):
    """canonical()'s string of a tree: a chain of + (or of *) one sorted list, - and / as written, every operation
    but the outermost bracketed."""
    if isinstance(tree, int):
        return str(tree)
    if tree[0] in "+*":
        return tree[0].join(sorted(bracketed(t) for t in chain(tree, tree[0])))
    return f"{bracketed(tree[1])}{tree[0]}{bracketed(tree[2])}"


def bracketed(tree):
    return str(tree) if isinstance(tree, int) else f"({form(tree)})"


def chain(tree, op):
    """The operands of a chain of op (associativity): a+(b+c) -> [a, b, c]; a+(b-c) -> [a, b-c]."""
    if isinstance(tree, int) or tree[0] != op:
        return [tree]
    return chain(tree[1], op) + chain(tree[2], op)
