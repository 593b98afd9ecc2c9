"""A grammar for normalised LaTeX answers that builds sympy values from tokens.

Model output is data, never code: this module never hands a string to anything that parses or
evaluates it (`eval`, `exec`, `sympify`, `parse_expr`, `S("...")`, `Rational("...")`,
`Float("...")`, or a sympy function that re-parses a string argument). A tokenizer cuts the
answer into numbers, single letters, commands and operators; a recursive-descent parser builds
the value from them with sympy constructors that only ever receive sympy objects or Python
ints:

  - numbers: `Integer(int(d))` of a validated ASCII digit string, decimals as the exact
    `Rational(int(digits), 10**k)` (no Float);
  - symbols: one ASCII letter (optionally subscripted, `x_1`, `a_{12}`), or a Greek letter
    from a fixed list; `e` and `i` are Euler's number and the imaginary unit (as in MATH);
  - constants `\\pi`, `\\infty`;
  - `+ - * / ^`, `\\cdot`, `\\times`, `\\div`, implicit multiplication (`2x`, `3\\sqrt{2}`),
    unary minus, factorials `n!` and `n!!`, `\\frac`, `\\sqrt{}` and `\\sqrt[n]{}`,
    `\\binom`, a fixed set of functions (`\\sin` ... `\\log_b`, `\\ln`, `\\exp`; `\\sin^{-1}`
    and kin are the inverse functions, `\\sin^2 x` a power),
    parentheses and comma tuples;
  - spacing commands, `\\left` / `\\right`, `\\displaystyle`, `\\mathrm` and percent signs
    are ignored (`jetrl.data.math_normalize` already drops them).

Anything else (another command, a quote, a dot that is not part of a number, `<`, a deeper
nesting than MAX_DEPTH, a power or factorial whose exact value would be huge) is
`Unsupported`, which the caller scores as "not shown equal". The size guards refuse a value
before sympy computes it, so `10^{10^{10}}` costs microseconds instead of the worker's memory.

The tokenizer and the lexicon are in `latex_tokens.py`, imported relatively: this module
imports only the standard library, that sibling and sympy (lazily), so the sympy worker process
loads the pair by file path without importing jetrl (`jetrl.data.sympy_worker.load_grammar`).
See docs/reliability.md.
"""

import math
import re

from .latex_tokens import FRACS, FUNCTIONS, GREEK, INVERSES, PLAIN_NAMES, TIMES
from .latex_tokens import Unsupported, tokenize

MAX_DEPTH = 48  # nesting of groups, parentheses and operands
MAX_BITS = 100_000  # largest exact power / binomial result, in bits (~30,000 digits)
MAX_EXPONENT = 10_000  # largest integer exponent of an irrational numeric base
MAX_FACTORIAL = 2_000  # largest n for which n! is computed exactly
MAX_ITEMS = 32  # items of a comma tuple


class _Parser:
  """Recursive descent over the token list; every method returns a sympy object."""

  def __init__(self, tokens, sympy):
    self.toks = tokens
    self.i = 0
    self.depth = 0
    self.sp = sympy

  # ---- token helpers -------------------------------------------------------------------

  def peek(self):
    return self.toks[self.i] if self.i < len(self.toks) else (None, None)

  def take(self):
    tok = self.peek()
    if tok[0] is None:
      raise Unsupported("unexpected end")
    self.i += 1
    return tok

  def is_op(self, *ops):
    kind, text = self.peek()
    return kind == "op" and text in ops

  def expect_op(self, op):
    if not self.is_op(op):
      raise Unsupported(f"expected {op!r}")
    self.i += 1

  def enter(self):
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise Unsupported("nested too deeply")

  def leave(self):
    self.depth -= 1

  # ---- grammar -------------------------------------------------------------------------

  def parse(self):
    """answer := sum (',' sum)*   (an unbracketed list is a Tuple, as in `1, -2`)"""
    value = self.items()
    value = value[0] if len(value) == 1 else self.sp.Tuple(*value)
    if self.i != len(self.toks):
      raise Unsupported(f"unexpected {self.peek()[1]!r}")
    return value

  def expr(self):
    """sum := term (('+' | '-') term)*"""
    self.enter()
    value = self.term()
    while self.is_op("+", "-"):
      sign = self.take()[1]
      right = self.scalar(self.term())
      value = self.sp.Add(self.scalar(value), right if sign == "+" else self.sp.Mul(-1, right))
    self.leave()
    return value

  def term(self):
    """term := signed (('*' | '/' | \\cdot | \\times | \\div) signed | implicit factor)*"""
    value = self.signed()
    while True:
      kind, text = self.peek()
      if (kind == "op" and text == "*") or (kind == "cmd" and text in TIMES):
        self.i += 1
        value = self.sp.Mul(self.scalar(value), self.scalar(self.signed()))
      elif (kind == "op" and text == "/") or (kind == "cmd" and text == "div"):
        self.i += 1
        value = self.sp.Mul(self.scalar(value), self.sp.Pow(self.scalar(self.signed()), -1))
      elif self.starts_factor():
        value = self.sp.Mul(self.scalar(value), self.scalar(self.power()))
      else:
        return value

  def signed(self):
    """signed := ('-' | '+') signed | power   (so -x^2 is -(x^2))"""
    if self.is_op("-", "+"):
      sign = self.take()[1]
      self.enter()
      value = self.scalar(self.signed())
      self.leave()
      return self.sp.Mul(-1, value) if sign == "-" else value
    return self.power()

  def power(self):
    """power := postfix ('^' script)?"""
    base = self.postfix()
    if self.is_op("^"):
      self.i += 1
      base = self.factorials(self.pow(base, self.script()))
    return base

  def postfix(self):
    """postfix := atom ('!' | '!!')*"""
    return self.factorials(self.atom())

  def factorials(self, value):
    while self.is_op("!"):
      self.i += 1
      double = self.is_op("!")
      self.i += double
      value = self.factorial(value, double)
    return value

  def starts_factor(self) -> bool:
    kind, text = self.peek()
    if kind in ("num", "letter"):
      return True
    if kind == "op":
      return text in ("(", "[", "{")
    if kind == "cmd":
      return (
        text in FRACS
        or text in FUNCTIONS
        or text in GREEK
        or text in ("sqrt", "binom", "pi", "infty")
      )
    return False

  def script(self):
    """The argument of ^ or _: a {group}, or one character / command (LaTeX: x^23 is x^2 3)."""
    kind, text = self.peek()
    if kind == "op" and text == "{":
      return self.group()
    if kind == "op" and text == "-":
      self.i += 1
      self.enter()
      value = self.sp.Mul(-1, self.scalar(self.script()))
      self.leave()
      return value
    if kind == "num":
      if text[0] == ".":
        raise Unsupported("script")
      if len(text) > 1:  # only the first digit belongs to the script
        self.toks[self.i] = ("num", text[1:])
      else:
        self.i += 1
      return self.sp.Integer(int(text[0]))
    if kind in ("letter", "cmd"):
      self.enter()
      value = self.atom()
      self.leave()
      return value
    raise Unsupported("script")

  def group(self):
    """'{' sum '}'"""
    self.expect_op("{")
    value = self.expr()
    self.expect_op("}")
    return value

  def argument(self):
    """A command's argument: a {group}, or one character / command (\\frac12)."""
    if self.is_op("{"):
      return self.group()
    return self.script()

  def atom(self):
    kind, text = self.peek()
    if kind == "num":
      self.i += 1
      return self.number(text)
    if kind == "letter":
      return self.letters()
    if kind == "op" and text in ("(", "["):
      return self.parenthesised()
    if kind == "op" and text == "{":
      return self.group()
    if kind == "cmd":
      self.i += 1
      return self.command(text)
    raise Unsupported(f"unexpected {text!r}")

  def number(self, text: str):
    whole, _, frac = text.partition(".")
    if not re.fullmatch(r"[0-9]*", whole) or not re.fullmatch(r"[0-9]*", frac):
      raise Unsupported("number")
    if not frac:
      return self.sp.Integer(int(whole))
    return self.sp.Rational(int(whole + frac), 10 ** len(frac))

  def letters(self):
    """A run of letters: a plain function or constant name if it is exactly one, else one
    symbol per letter (implicit multiplication, as in `2xy`)."""
    j = self.i
    while j < len(self.toks) and self.toks[j][0] == "letter":
      j += 1
    run = "".join(t for _, t in self.toks[self.i : j])
    if run in PLAIN_NAMES:
      self.i = j
      return self.command(run)
    _, letter = self.take()
    if self.is_op("_"):
      self.i += 1
      return self.sp.Symbol(f"{letter}_{self.subscript()}")
    if letter == "e":
      return self.sp.E
    if letter == "i":
      return self.sp.I
    return self.sp.Symbol(letter)

  def subscript(self) -> str:
    """The name of a subscript: letters and digits only (x_1, a_{12}, x_n)."""
    if self.is_op("{"):
      self.i += 1
      parts = []
      while not self.is_op("}"):
        kind, text = self.take()
        if kind not in ("num", "letter") or "." in text:
          raise Unsupported("subscript")
        parts.append(text)
      self.i += 1
      name = "".join(parts)
    else:
      kind, text = self.take()
      if kind not in ("num", "letter"):
        raise Unsupported("subscript")
      if kind == "num":
        if "." in text:
          raise Unsupported("subscript")
        if len(text) > 1:  # x_12 is x_1 times 2 in LaTeX
          self.i -= 1
          self.toks[self.i] = ("num", text[1:])
          text = text[0]
      name = text
    if not 0 < len(name) <= 8:
      raise Unsupported("subscript")
    return name

  def items(self) -> list:
    """sum (',' sum)*"""
    items = [self.expr()]
    while self.is_op(","):
      self.i += 1
      items.append(self.expr())
      if len(items) > MAX_ITEMS:
        raise Unsupported("too many items")
    return items

  def parenthesised(self):
    """'(' sum (',' sum)* ')' is a value or a Tuple; '[' sum ']' a value. Intervals such as
    `[1, 2)` are compared by jetrl.data.math_equivalence, never here."""
    closer = ")" if self.take()[1] == "(" else "]"
    self.enter()
    items = self.items()
    if not self.is_op(closer) or (closer == "]" and len(items) > 1):
      raise Unsupported("brackets")
    self.i += 1
    self.leave()
    return items[0] if len(items) == 1 else self.sp.Tuple(*items)

  def command(self, name: str):
    sp = self.sp
    if name in FRACS:
      num = self.scalar(self.argument())
      den = self.scalar(self.argument())
      return sp.Mul(num, sp.Pow(den, -1))
    if name == "sqrt":
      index = None
      if self.is_op("["):
        self.i += 1
        self.enter()
        index = self.scalar(self.expr())
        self.leave()
        self.expect_op("]")
      radicand = self.scalar(self.argument())
      return sp.sqrt(radicand) if index is None else self.pow(radicand, sp.Pow(index, -1))
    if name == "binom":
      return self.binomial(self.scalar(self.argument()), self.scalar(self.argument()))
    if name in FUNCTIONS:
      return self.function(name)
    if name == "pi":
      return sp.pi
    if name == "infty":
      return sp.oo
    if name in GREEK:
      return sp.Symbol(name)
    raise Unsupported(f"command \\{name}")

  def function(self, name: str):
    """\\sin x, \\sin(x), \\sin^2 x, \\log_2 8, \\ln x: the argument is a parenthesised
    group, a {group}, or the implicit product that follows (\\sin 2x is sin(2x)). A power of
    a trigonometric or hyperbolic function is a power of its value (\\sin^2 x), except
    `^{-1}`, the inverse function (\\sin^{-1} x is arcsin x); other negative powers are
    refused."""
    sp = self.sp
    base = exponent = None
    if FUNCTIONS[name] == "log" and self.is_op("_"):
      self.i += 1
      base = self.script()
    if self.is_op("^"):
      self.i += 1
      exponent = self.script()
    self.enter()
    if self.is_op("(", "[", "{"):
      arg = self.atom()
    else:
      arg = self.power()
      while self.starts_factor() and self.peek()[1] not in FUNCTIONS:
        arg = sp.Mul(arg, self.power())
    self.leave()
    arg = self.scalar(arg)
    if exponent is not None and exponent == -1 and FUNCTIONS[name] in INVERSES:
      return getattr(sp, INVERSES[FUNCTIONS[name]])(arg)  # \sin^{-1} x is arcsin x
    if exponent is not None and FUNCTIONS[name] in INVERSES and exponent.is_negative:
      raise Unsupported("a negative power of a trigonometric function")  # \sin^{-2}: unclear
    fn = getattr(sp, FUNCTIONS[name])
    value = fn(arg) if base is None else sp.log(arg, self.scalar(base))
    return value if exponent is None else self.pow(value, exponent)

  # ---- guarded constructors ------------------------------------------------------------

  def scalar(self, value):
    """`value` if it is a sympy expression (a tuple cannot be an operand)."""
    if not isinstance(value, self.sp.Expr):
      raise Unsupported("a tuple inside an expression")
    return value

  def pow(self, base, exponent):
    """base ** exponent, refusing exact results too large to compute."""
    sp = self.sp
    base, exponent = self.scalar(base), self.scalar(exponent)
    if base.is_Rational and exponent.is_Rational and base not in (0, 1, -1):
      size = math.log2(max(abs(int(base.p)), int(base.q)))  # bits per factor of the base
      if abs(exponent) * size > MAX_BITS:
        raise Unsupported("power too large")
    elif base.is_number and exponent.is_Rational and abs(exponent) > MAX_EXPONENT:
      raise Unsupported("power too large")
    return sp.Pow(base, exponent)

  def factorial(self, value, double: bool = False):
    """n! (or the double factorial n!!), refusing n > MAX_FACTORIAL."""
    value = self.scalar(value)
    if value.is_Integer and value > MAX_FACTORIAL:
      raise Unsupported("factorial too large")
    if value.is_number and not value.is_Rational:
      raise Unsupported("factorial of an irrational number")
    return self.sp.factorial2(value) if double else self.sp.factorial(value)

  def binomial(self, n, k):
    if k.is_Integer and abs(k) > MAX_FACTORIAL:
      raise Unsupported("binomial too large")
    if n.is_Integer and k.is_Integer and 0 <= k <= n:
      small = min(int(k), int(n - k))
      if small * math.log2(max(int(n), 2)) > MAX_BITS:
        raise Unsupported("binomial too large")
    return self.sp.binomial(n, k)


def parse_latex(s: str):
  """The sympy value of a normalised LaTeX answer; raises Unsupported outside the grammar."""
  import sympy  # pylint: disable=import-outside-toplevel

  return _Parser(tokenize(s), sympy).parse()
