"""`quantization_config.modules_to_not_convert` matched as HF transformers matches it, in time
linear in the module name's length, whatever the pattern.

transformers 5.24.0, src/transformers/quantizers/quantizers_utils.py, `should_convert_module`
(used by integrations/finegrained_fp8.py `replace_with_fp8_linear` for FP8 checkpoints): a
module is left unconverted when, for some key,

    re.match(rf"(?:{key})(?:(?<=\\.)|(?=\\.|$))", full_name) or full_name.endswith(key)

i.e. the key as a regular expression matches from the start of the name up to a module boundary
(just after a '.', just before one, or at the end), or the key is a literal suffix of the name.

Python's `re` backtracks: a key such as `(.*)*X` takes exponential time on a 30-character name,
and a checkpoint's config.json is input we do not control. So the key is compiled here into a
Thompson NFA and simulated over the name once (the set of live states per position), which
yields every end position of a match from the start; the boundary is then checked at those
positions. That is exactly `re.match`'s answer for the syntax accepted here: literals and
escapes, `.`, character classes, groups (`(...)`, `(?:...)`, `(?P<name>...)`), alternation,
`* + ?` (greedy or lazy: laziness changes which match is found, not whether one exists),
`{m}`, `{m,}`, `{m,n}` (bounded by MAX_REPEAT), and the anchors `^ $ \\A \\Z`. What backtracking
alone can do (backreferences, lookaround, possessive repeats, inline flags, `\\b`) is refused
with PatternError naming the construct, as is an invalid pattern (where transformers would
raise `re.error`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

#: A longer key is refused: no checkpoint needs one, and it bounds the work per module name.
MAX_PATTERN_LENGTH = 1000
#: The largest count of a `{m,n}` repeat, and of NFA states the expanded pattern may need.
MAX_REPEAT = 100
MAX_STATES = 20_000

_CHAR, _SPLIT, _EPS, _START, _END, _MATCH = range(6)
_METACHARACTERS = frozenset("\\^$*+?{}[]()|")


class PatternError(ValueError):
    """A modules_to_not_convert key this matcher refuses (unsupported or invalid syntax)."""


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


_CLASS_ESCAPES: dict[str, Callable[[str], bool]] = {
    "d": str.isdecimal, "D": lambda c: not c.isdecimal(),
    "w": _is_word, "W": lambda c: not _is_word(c),
    "s": str.isspace, "S": lambda c: not c.isspace(),
}
_CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


@dataclasses.dataclass(eq=False)           # hashed by identity: sets of states are DFA states
class _State:
    kind: int
    test: Callable[[str], bool] | None = None
    out: "_State | None" = None
    out2: "_State | None" = None


class _Fragment:
    """A piece of NFA: its start state and the dangling exits to patch to what follows."""

    def __init__(self, start: _State, exits: list[tuple[_State, str]]):
        self.start, self.exits = start, exits

    def patch(self, target: _State) -> None:
        for state, attr in self.exits:
            setattr(state, attr, target)


class _Parser:
    """Recursive descent over Python's regex syntax (the subset above), building NFA
    fragments. Repeats are expanded into copies, so the pattern is re-parsed per copy: each
    copy needs its own states."""

    def __init__(self, pattern: str):
        self.pattern, self.pos, self.states = pattern, 0, 0

    def fail(self, what: str) -> PatternError:
        return PatternError(f"{what} at position {self.pos} of {self.pattern!r}")

    def state(self, kind: int, test=None) -> _State:
        self.states += 1
        if self.states > MAX_STATES:
            raise PatternError(f"{self.pattern!r} expands to more than {MAX_STATES} states (repeats too large)")
        return _State(kind, test)

    def peek(self, n: int = 1) -> str:
        return self.pattern[self.pos:self.pos + n]

    def parse(self) -> _Fragment:
        fragment = self.alternation()
        if self.pos < len(self.pattern):
            raise self.fail("unbalanced parenthesis")
        return fragment

    def alternation(self) -> _Fragment:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        fragment = branches[0]
        for branch in branches[1:]:
            split = self.state(_SPLIT)
            split.out, split.out2 = fragment.start, branch.start
            fragment = _Fragment(split, fragment.exits + branch.exits)
        return fragment

    def sequence(self) -> _Fragment:
        pieces = []
        while self.pos < len(self.pattern) and self.peek() not in "|)":
            pieces.append(self.repeat())
        if not pieces:
            empty = self.state(_EPS)
            return _Fragment(empty, [(empty, "out")])
        for left, right in zip(pieces, pieces[1:]):
            left.patch(right.start)
        return _Fragment(pieces[0].start, pieces[-1].exits)

    def repeat(self) -> _Fragment:
        atom_start = self.pos
        fragment = self.atom()
        atom_end = self.pos
        bounds = self.quantifier()
        if bounds is None:
            return fragment
        if self.pattern[atom_start] != "(" and fragment.start.kind in (_START, _END):
            raise self.fail("nothing to repeat (an anchor)")
        low, high = bounds
        if self.peek() == "?":
            self.pos += 1                       # lazy: the same set of matches
        if self.peek() in ("*", "+") or (self.peek() == "{" and self.counted() is not None):
            raise self.fail("a possessive or repeated quantifier")
        after = self.pos

        def copy() -> _Fragment:
            self.pos = atom_start
            piece = self.atom()
            assert self.pos == atom_end
            return piece

        pieces = [fragment] + [copy() for _ in range(max(low, 1) - 1)] if low else []
        if high is None:                        # then any number more: a loop
            loop = self.state(_SPLIT)
            body = copy() if pieces else fragment
            loop.out = body.start
            body.patch(loop)
            tail = _Fragment(loop, [(loop, "out2")])
            pieces.append(tail)
        else:
            for _ in range(high - low):         # optional copies, each skippable
                body = copy() if pieces else fragment
                split = self.state(_SPLIT)
                split.out = body.start
                pieces.append(_Fragment(split, body.exits + [(split, "out2")]))
        self.pos = after
        if not pieces:                          # {0} / {0,0}: matches the empty string
            empty = self.state(_EPS)
            return _Fragment(empty, [(empty, "out")])
        for left, right in zip(pieces, pieces[1:]):
            left.patch(right.start)
        return _Fragment(pieces[0].start, pieces[-1].exits)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c == "{":
            bounds = self.counted()
            if bounds is not None:
                self.pos = self.pattern.index("}", self.pos) + 1
            return bounds
        return None

    def counted(self) -> tuple[int, int | None] | None:
        """`{m}`, `{m,}`, `{,n}`, `{m,n}` at pos (None: a literal '{', as in Python)."""
        end = self.pattern.find("}", self.pos)
        if end < 0:
            return None
        body = self.pattern[self.pos + 1:end]
        low, comma, high = body.partition(",")
        digits = set("0123456789")
        if not body or not set(low) <= digits or not set(high) <= digits:
            return None
        lo = int(low) if low else 0
        hi = int(high) if high else (None if comma else lo)
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            raise self.fail(f"a repeat count above {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.fail("a repeat with min > max")
        return lo, hi

    def atom(self) -> _Fragment:
        c = self.peek()
        if c == "(":
            return self.group()
        if c in ("*", "+", "?") or (c == "{" and self.counted() is not None):
            raise self.fail("nothing to repeat")
        self.pos += 1
        if c == "[":
            return self.single(self.char_class())
        if c == ".":
            return self.single(lambda ch: ch != "\n")
        if c == "^":
            return self.assertion(_START)
        if c == "$":
            return self.assertion(_END)
        if c == "\\":
            return self.escape()
        return self.single(lambda ch, c=c: ch == c)

    def group(self) -> _Fragment:
        self.pos += 1
        if self.peek() == "?":
            if self.peek(2) == "?:":
                self.pos += 2
            elif self.peek(3) == "?P<":
                close = self.pattern.find(">", self.pos)
                name = self.pattern[self.pos + 3:close] if close > 0 else ""
                if not name.isidentifier():
                    raise self.fail("a bad group name")
                self.pos = close + 1
            else:
                raise self.fail(f"the unsupported group '(?{self.peek(2)[1:]}' (lookaround, flags, "
                                "backreference or conditional)")
        fragment = self.alternation()
        if self.peek() != ")":
            raise self.fail("missing ')'")
        self.pos += 1
        return fragment

    def escape(self) -> _Fragment:
        c = self.peek()
        if not c:
            raise self.fail("a bad escape at the end")
        self.pos += 1
        if c == "A":
            return self.assertion(_START)
        if c == "Z":
            return self.assertion(_END, strict=True)
        return self.single(self.escaped(c, in_class=False))

    def escaped(self, c: str, in_class: bool) -> Callable[[str], bool]:
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CONTROL_ESCAPES:
            return lambda ch, lit=_CONTROL_ESCAPES[c]: ch == lit
        if c.isalnum():                 # \1 (backreference), \b, \x41, \u..., or Python's error
            raise self.fail(f"the unsupported escape '\\{c}'")
        return lambda ch: ch == c

    def char_class(self) -> Callable[[str], bool]:
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        items: list[Callable[[str], bool]] = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.fail("an unterminated character class")
            if c == "]" and not first:
                self.pos += 1
                break
            first = False
            self.pos += 1
            if c == "\\":
                e = self.peek()
                if not e:
                    raise self.fail("an unterminated character class")
                self.pos += 1
                if e in _CLASS_ESCAPES:
                    items.append(_CLASS_ESCAPES[e])
                    continue
                low = _CONTROL_ESCAPES.get(e, e)
                if e.isalnum() and e not in _CONTROL_ESCAPES:
                    raise self.fail(f"the unsupported escape '\\{e}' in a character class")
            elif c == "[" and self.peek() in (":", "=", "."):
                raise self.fail("a POSIX class or nested set")
            else:
                low = c
            if self.peek() == "-" and self.peek(2)[1:] not in ("", "]"):
                self.pos += 1
                high = self.peek()
                self.pos += 1
                if high == "\\":
                    e = self.peek()
                    self.pos += 1
                    if e.isalnum() and e not in _CONTROL_ESCAPES:
                        raise self.fail(f"a bad range end '\\{e}'")
                    high = _CONTROL_ESCAPES.get(e, e)
                if high < low:
                    raise self.fail(f"the bad range {low}-{high}")
                items.append(lambda ch, lo=low, hi=high: lo <= ch <= hi)
            else:
                items.append(lambda ch, lit=low: ch == lit)
        return (lambda ch: not any(t(ch) for t in items)) if negate else (lambda ch: any(t(ch) for t in items))

    def single(self, test: Callable[[str], bool]) -> _Fragment:
        s = self.state(_CHAR, test)
        return _Fragment(s, [(s, "out")])

    def assertion(self, kind: int, strict: bool = False) -> _Fragment:
        s = self.state(kind, test=(lambda: True) if strict else None)   # test marks \Z (end only)
        return _Fragment(s, [(s, "out")])


class ModulePattern:
    """One modules_to_not_convert key, compiled: `matches(name)` is transformers'
    `not should_convert_module(name, [key])`."""

    def __init__(self, key: str):
        if not isinstance(key, str):
            raise PatternError(f"a string, got {type(key).__name__}")
        if len(key) > MAX_PATTERN_LENGTH:
            raise PatternError(f"at most {MAX_PATTERN_LENGTH} characters, got {len(key)}")
        self.key = key
        # Most keys are module names: without metacharacters but '.', which matches any
        # character but a newline, a key matches exactly len(key) characters or nothing.
        self._fixed = not any(c in _METACHARACTERS for c in key)
        parser = _Parser(key)
        fragment = parser.parse()
        self._match = _State(_MATCH)
        fragment.patch(self._match)
        self._initial = self._closure([fragment.start], at_start=True)
        self._cache: dict[tuple[frozenset, str], frozenset] = {}

    # The NFA runs as a lazily built DFA: a set of live states (after following empty moves)
    # is a DFA state, its successor per character is computed once and cached, so each name
    # costs one dictionary lookup per character. The anchors depend on the position, not on
    # the character: `^` / `\A` pass only in the first set (at_start), and `$` / `\Z` stay in
    # the set as pending states, followed only where the name ends (_through_ends).
    _MAX_CACHED = 10_000

    def _closure(self, states, at_start: bool) -> frozenset:
        seen: set[int] = set()
        out = []
        stack = list(states)
        while stack:
            s = stack.pop()
            if s is None or id(s) in seen:
                continue
            seen.add(id(s))
            if s.kind == _SPLIT:
                stack.extend((s.out2, s.out))
            elif s.kind == _EPS:
                stack.append(s.out)
            elif s.kind == _START:
                if at_start:
                    stack.append(s.out)
            else:                               # a character test, a pending end anchor, or MATCH
                out.append(s)
        return frozenset(out)

    def _step(self, live: frozenset, ch: str) -> frozenset:
        key = (live, ch)
        nxt = self._cache.get(key)
        if nxt is None:
            nxt = self._closure([s.out for s in live if s.kind == _CHAR and s.test(ch)], at_start=False)
            if len(self._cache) < self._MAX_CACHED:
                self._cache[key] = nxt
        return nxt

    def _through_ends(self, live: frozenset, name: str, pos: int) -> frozenset:
        """live plus what the pending end anchors lead to at pos: `\\Z` holds at the end of the
        name, `$` there or before a final newline (which a later `\n` may still consume)."""
        n = len(name)
        at_end, before_newline = pos == n, pos == n - 1 and name[pos] == "\n"
        if not (at_end or before_newline) or not any(s.kind == _END for s in live):
            return live
        out, seen = set(live), set()
        stack = [s for s in live if s.kind == _END]
        while stack:
            s = stack.pop()
            if s is None or s in seen:
                continue
            seen.add(s)
            if s.kind == _END:
                out.add(s)
                if at_end or s.test is None:
                    stack.append(s.out)
            elif s.kind == _SPLIT:
                stack.extend((s.out, s.out2))
            elif s.kind == _EPS or (s.kind == _START and pos == 0):
                stack.append(s.out)
            elif s.kind != _START:
                out.add(s)
        return frozenset(out)

    def match_ends(self, name: str) -> list[int]:
        """Every position p such that the key matches name[:p] from the start."""
        if self._fixed:
            n = len(self.key)
            head = name[:n]
            return [n] if len(head) == n and all(k == c or (k == "." and c != "\n") for k, c in zip(self.key, head)) \
                else []
        ends = []
        live = self._initial
        last = len(name)
        for pos in range(last + 1):
            if pos >= last - 1:
                live = self._through_ends(live, name, pos)
            if self._match in live:
                ends.append(pos)
            if pos == last or not live:
                break
            live = self._step(live, name[pos])
        return ends

    def matches(self, name: str) -> bool:
        if name.endswith(self.key):
            return True
        n = len(name)
        # `(?<=\.)` after the match, or `(?=\.|$)`; `$` also holds before a final newline
        return any((p > 0 and name[p - 1] == ".") or p == n or name[p] == "." or (p == n - 1 and name[p] == "\n")
                   for p in self.match_ends(name))


__all__ = ["ModulePattern", "PatternError", "MAX_PATTERN_LENGTH", "MAX_REPEAT"]
