"""Generate eagle3's built-in prompt set (prompts.jsonl next to this file), deterministically.

    python eagle3/data/builtin/make_prompts.py          # rewrites prompts.jsonl and long_context.jsonl
    python eagle3/data/builtin/make_prompts.py --check  # fails if either is out of date

Prompts come from hand-written templates and word lists, expanded with a seeded RNG. They are kept
short and concrete: the default target (SmolLM2-135M-Instruct) is tiny and most coherent on code
and simple questions. Every conversation ends on a user turn; multi-turn items carry earlier
assistant turns written here (short, plausible), which the default pipeline regenerates anyway.
The file is shuffled so that any prefix (CI uses the first few dozen) mixes all categories; the
code-completion prompts (a signature and a docstring to complete, as in common code benchmarks)
follow at the end, with functions kept apart from the held-out ones of
bench/prompts/code_completion.jsonl.

Large mode (``--large N``, or ``build_large(N)``; the prepare stage reads it as
``data.path=builtin:large``, see ``experiment=smollm2_large``) expands the same templates over
every combination, several programming languages, audiences and styles, unbounded maths, and
questions about the public functions of Python's standard library (text that ships with every
Python: the set is reproducible for a given Python minor version). Its multi-turn items carry a
worked earlier answer only where one is known to be right (maths, the functions above); the
pipeline regenerates every assistant turn anyway.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path

SEED = 20250101
OUT = Path(__file__).resolve().parent / "prompts.jsonl"
LONG_OUT = Path(__file__).resolve().parent / "long_context.jsonl"

# ----------------------------------------------------------------------------- code

# (name, what it does, a short correct implementation used as an earlier assistant turn)
FUNCTIONS = [
    ("sum_list", "returns the sum of a list of numbers",
     "def sum_list(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n    return total"),
    ("is_palindrome", "checks whether a string is a palindrome",
     "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]"),
    ("count_vowels", "counts the vowels in a string",
     "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')"),
    ("factorial", "returns the factorial of a non-negative integer n",
     "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
    ("reverse_list", "reverses a list without using the built-in reverse method",
     "def reverse_list(items):\n    return items[::-1]"),
    ("find_max", "finds the largest number in a list",
     "def find_max(numbers):\n    best = numbers[0]\n    for n in numbers[1:]:\n        if n > best:\n"
     "            best = n\n    return best"),
    ("dedupe", "removes duplicates from a list while keeping the original order",
     "def dedupe(items):\n    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n"
     "            seen.add(x)\n            out.append(x)\n    return out"),
    ("celsius_to_fahrenheit", "converts a temperature from Celsius to Fahrenheit",
     "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32"),
    ("fibonacci", "returns the n-th Fibonacci number",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("is_prime", "checks whether a number is prime",
     "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
     "        if n % i == 0:\n            return False\n        i += 1\n    return True"),
    ("merge_sorted", "merges two sorted lists into one sorted list",
     "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
     "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
     "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]"),
    ("word_counts", "counts how often each word appears in a sentence",
     "def word_counts(sentence):\n    counts = {}\n    for word in sentence.lower().split():\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts"),
    ("flatten", "flattens a nested list of lists into a single list",
     "def flatten(nested):\n    return [x for sub in nested for x in sub]"),
    ("second_largest", "returns the second largest distinct number in a list",
     "def second_largest(numbers):\n    distinct = sorted(set(numbers))\n    return distinct[-2]"),
    ("title_case", "capitalizes the first letter of every word in a sentence",
     "def title_case(sentence):\n    return ' '.join(w[:1].upper() + w[1:] for w in sentence.split())"),
    ("average", "computes the average of a list of numbers",
     "def average(numbers):\n    return sum(numbers) / len(numbers)"),
    ("gcd", "returns the greatest common divisor of two integers",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a"),
    ("are_anagrams", "checks whether two strings are anagrams of each other",
     "def are_anagrams(a, b):\n    return sorted(a.lower()) == sorted(b.lower())"),
    ("binary_search", "finds the index of a value in a sorted list using binary search",
     "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
     "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
     "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
     "    return -1"),
    ("chunks", "splits a list into chunks of size n",
     "def chunks(items, n):\n    return [items[i:i + n] for i in range(0, len(items), n)]"),
    ("count_lines", "reads a text file and returns the number of lines in it",
     "def count_lines(path):\n    with open(path) as f:\n        return sum(1 for _ in f)"),
    ("evens", "returns all even numbers from a list",
     "def evens(numbers):\n    return [n for n in numbers if n % 2 == 0]"),
    ("dot", "computes the dot product of two vectors given as lists",
     "def dot(a, b):\n    return sum(x * y for x, y in zip(a, b))"),
    ("binary_to_int", "converts a string of 0s and 1s to an integer",
     "def binary_to_int(bits):\n    value = 0\n    for b in bits:\n        value = value * 2 + int(b)\n"
     "    return value"),
    ("longest_word", "returns the longest word in a sentence",
     "def longest_word(sentence):\n    return max(sentence.split(), key=len)"),
    ("is_leap_year", "checks whether a year is a leap year",
     "def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)"),
    ("sort_by_key", "sorts a list of dictionaries by a given key",
     "def sort_by_key(records, key):\n    return sorted(records, key=lambda r: r[key])"),
    ("transpose", "transposes a matrix given as a list of lists",
     "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]"),
    ("digits", "returns the digits of a non-negative integer as a list",
     "def digits(n):\n    return [int(d) for d in str(n)]"),
    ("running_total", "returns the running totals of a list of numbers",
     "def running_total(numbers):\n    out, total = [], 0\n    for n in numbers:\n        total += n\n"
     "        out.append(total)\n    return out"),
    ("count_char", "counts how many times a character appears in a string",
     "def count_char(s, ch):\n    return sum(1 for c in s if c == ch)"),
    ("square_all", "returns a new list with every number squared",
     "def square_all(numbers):\n    return [n * n for n in numbers]"),
    ("min_max", "returns both the smallest and the largest value of a list",
     "def min_max(numbers):\n    return min(numbers), max(numbers)"),
    ("remove_spaces", "removes all spaces from a string",
     "def remove_spaces(s):\n    return s.replace(' ', '')"),
    ("is_sorted", "checks whether a list is sorted in ascending order",
     "def is_sorted(items):\n    return all(a <= b for a, b in zip(items, items[1:]))"),
    ("invert_dict", "swaps the keys and values of a dictionary",
     "def invert_dict(d):\n    return {v: k for k, v in d.items()}"),
    ("fizzbuzz", "prints the numbers from 1 to n, but Fizz for multiples of 3, Buzz for multiples of 5 "
     "and FizzBuzz for multiples of both",
     "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
     "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
     "        else:\n            print(i)"),
    ("power_set", "returns all subsets of a small list",
     "def power_set(items):\n    subsets = [[]]\n    for x in items:\n        subsets += [s + [x] for s in subsets]\n"
     "    return subsets"),
    ("char_frequency", "returns the most common character in a string",
     "def char_frequency(s):\n    return max(set(s), key=s.count)"),
    ("clamp", "limits a number to a given minimum and maximum",
     "def clamp(x, low, high):\n    return max(low, min(x, high))"),
]

FUNCTION_ASKS = [
    "Write a Python function that {what}.",
    "Write a Python function `{name}` that {what}.",
    "Implement `{name}` in Python: it {what}. Include a docstring.",
    "Can you write a short Python function that {what}?",
    "Write a Python function that {what}, and show one example call.",
    "I need a Python function called {name} that {what}. Keep it simple.",
    "Show me how to write a function in Python that {what}.",
]

# Code completion, in the style of common code benchmarks: a signature and a docstring to complete.
# Functions of FUNCTIONS (their docstring from what they do) and the ones below. Kept out: the 16
# functions of the held-out completion prompts (bench/prompts/code_completion.jsonl) and the
# FUNCTIONS too close to one of them (clamp, word_counts ~ count_words, digits ~ digits_sum,
# running_total ~ running_mean), so the measurement on those prompts stays held out.
HELD_OUT_COMPLETIONS = {"running_mean", "pairwise_diffs", "count_words", "clamp", "rotate_left", "hamming_distance",
                        "nth_triangular", "digits_sum", "merge_dicts", "find_index", "initials", "group_by_length",
                        "safe_divide", "percent", "interleave", "longest_run"}
COMPLETION_EXCLUDED = HELD_OUT_COMPLETIONS | {"word_counts", "digits", "running_total"}
COMPLETION_FUNCTIONS = [  # (signature, docstring)
    ("def mean_abs(values):", "Return the mean of the absolute values in values."),
    ("def count_positive(numbers):", "Return how many numbers in the list are greater than zero."),
    ("def last_word(sentence):", "Return the last word of sentence, or an empty string if there is none."),
    ("def repeat_string(s, n):", "Return s repeated n times, separated by spaces."),
    ("def product(numbers):", "Return the product of all numbers in the list (1 for an empty list)."),
    ("def only_strings(items):", "Return the items of the list that are strings."),
    ("def index_of_max(values):", "Return the index of the largest value in a non-empty list."),
    ("def kebab_case(text):", "Return text in lowercase with spaces replaced by hyphens."),
    ("def sum_of_squares(n):", "Return 1*1 + 2*2 + ... + n*n."),
    ("def is_even(n):", "Return True if n is even, else False."),
    ("def unique_count(items):", "Return the number of distinct items in the list."),
    ("def swap_pairs(items):", "Return a copy of the list with each pair of neighbouring items swapped."),
    ("def first_duplicate(items):", "Return the first item that appears twice in the list, or None."),
    ("def capitalize_first(s):", "Return s with its first character in uppercase."),
    ("def count_upper(s):", "Return the number of uppercase letters in s."),
    ("def filter_short(words, n):", "Return the words that have at most n characters."),
    ("def total_length(strings):", "Return the total number of characters in a list of strings."),
    ("def to_binary(n):", "Return the binary representation of a non-negative integer as a string."),
    ("def every_other(items):", "Return every second item of the list, starting with the first."),
    ("def key_with_max_value(d):", "Return the key of the dictionary whose value is largest."),
    ("def strip_punctuation(text):", "Return text without the characters . , ! and ?."),
    ("def distance(p, q):", "Return the Euclidean distance between two points given as (x, y) tuples."),
    ("def is_subset(a, b):", "Return True if every item of list a is also in list b."),
    ("def zip_to_dict(keys, values):", "Return a dictionary that maps each key to the value at the same position."),
    ("def count_even(numbers):", "Return how many numbers in the list are even."),
    ("def reverse_words(sentence):", "Return the sentence with the order of its words reversed."),
    ("def average_length(words):", "Return the average number of characters per word, or 0 for an empty list."),
    ("def minutes_to_hours(minutes):", "Return a string like '2h 05m' for a number of minutes."),
    ("def nonzero(values):", "Return the values of the list that are not zero."),
    ("def contains_digit(s):", "Return True if s contains at least one digit."),
    ("def letter_positions(word):", "Return a dict mapping each letter of word to the positions where it appears."),
    ("def shift_right(items):", "Return the list with its last item moved to the front."),
    ("def isqrt_floor(n):", "Return the largest integer whose square is at most n."),
    ("def count_prefix(words, prefix):", "Return how many words start with prefix."),
    ("def mirror(s):", "Return s followed by s reversed."),
    ("def pad_left(s, width):", "Return s padded on the left with spaces to the given width."),
    ("def is_vowel(ch):", "Return True if ch is a vowel (a, e, i, o, u, in either case)."),
    ("def common_items(a, b):", "Return the items that appear in both lists, in the order of a."),
    ("def double_values(d):", "Return a new dictionary with every value of d multiplied by two."),
]
COMPLETION_ASKS = [
    "Complete the body of this Python function. Reply with the whole function in a code block.\n\n```python\n{stub}\n```",
    "Complete this Python function:\n\n```python\n{stub}\n```",
    "Finish the implementation:\n\n```python\n{stub}\n```",
    "Fill in the body of this function so that it does what its docstring says.\n\n```python\n{stub}\n```",
]


def completion_stubs() -> list:
    """(name, stub): a signature and its docstring, for every completion function of the set."""
    out = []
    for name, what, code in FUNCTIONS:
        if name not in COMPLETION_EXCLUDED:
            verb, rest = what.split(" ", 1)
            doc = f"{verb[:-1].capitalize()} {rest}."  # "returns the sum ..." -> "Return the sum ..."
            out.append((name, f'{code.splitlines()[0]}\n    """{doc}"""'))
    for sig, doc in COMPLETION_FUNCTIONS:
        out.append((sig[4:sig.index("(")], f'{sig}\n    """{doc}"""'))
    return out


# (buggy code, what it should do)
BUGS = [
    ("def average(numbers):\n    return sum(numbers) / len(numbers) + 1", "return the average of a list"),
    ("def is_even(n):\n    return n % 2 == 1", "return True for even numbers"),
    ("def factorial(n):\n    result = 0\n    for i in range(1, n + 1):\n        result *= i\n    return result",
     "return n factorial"),
    ("def last_item(items):\n    return items[len(items)]", "return the last element of a list"),
    ("def greet(name):\n    print('Hello, ' + name)\n\nmessage = greet('Ann')\nprint(message.upper())",
     "print a greeting in upper case"),
    ("def count_up(n):\n    i = 0\n    while i < n:\n        print(i)", "print the numbers from 0 to n - 1"),
    ("def add_item(item, items=[]):\n    items.append(item)\n    return items",
     "return a new list with the item each time it is called without a list"),
    ("def max_of(a, b):\n    if a > b:\n        return b\n    return a", "return the larger of two numbers"),
    ("def total_price(prices):\n    total = 0\n    for p in prices:\n        total = p\n    return total",
     "add up all prices"),
    ("def read_number():\n    value = input('Number: ')\n    return value * 2", "return twice the number the user types"),
    ("def contains(items, x):\n    for item in items:\n        if item == x:\n            return True\n        else:\n"
     "            return False", "tell whether x is anywhere in the list"),
    ("numbers = [1, 2, 3]\nfor i in range(len(numbers) + 1):\n    print(numbers[i])", "print every number in the list"),
    ("def celsius(f):\n    return f - 32 * 5 / 9", "convert Fahrenheit to Celsius"),
    ("def reverse(s):\n    for c in s:\n        out = c + out\n    return out", "reverse a string"),
    ("def squares(n):\n    result = []\n    for i in range(n):\n        result.append(i ** 2)\n        return result",
     "return the squares of 0 to n - 1"),
]
BUG_ASKS = [
    "This Python function should {goal}, but it does not work. Fix it:\n\n```python\n{code}\n```",
    "Find the bug in this code. It is supposed to {goal}.\n\n```python\n{code}\n```",
    "What is wrong with this function? It should {goal}.\n\n```python\n{code}\n```",
]

SNIPPETS = [
    "squares = [x * x for x in range(10)]",
    "words = sentence.split()\ncounts = {w: words.count(w) for w in set(words)}",
    "with open('data.txt') as f:\n    lines = [line.strip() for line in f]",
    "try:\n    value = int(text)\nexcept ValueError:\n    value = 0",
    "names = sorted(people, key=lambda p: p['age'])",
    "for i, name in enumerate(names, start=1):\n    print(i, name)",
    "pairs = list(zip(keys, values))\nlookup = dict(pairs)",
    "evens = list(filter(lambda n: n % 2 == 0, numbers))",
    "def greet(name='world'):\n    return f'Hello, {name}!'",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        self.count += 1",
    "import random\nroll = random.randint(1, 6)\nprint('You rolled', roll)",
    "total = sum(price * qty for price, qty in cart)",
    "if __name__ == '__main__':\n    main()",
    "text = ' '.join(reversed(sentence.split()))",
    "import json\nwith open('config.json') as f:\n    config = json.load(f)",
]
SNIPPET_ASKS = [
    "Explain what this Python code does:\n\n```python\n{code}\n```",
    "What does this code do? Explain it line by line.\n\n```python\n{code}\n```",
    "I am new to Python. Can you explain this snippet?\n\n```python\n{code}\n```",
]

CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "How do I read a CSV file in Python?",
    "What does the `yield` keyword do in Python?",
    "How do I reverse a string in Python?",
    "What is a dictionary in Python? Give a small example.",
    "How do I remove an item from a list in Python?",
    "What is the difference between `==` and `is` in Python?",
    "How do I write a for loop that counts down from 10 to 1 in Python?",
    "What is a list comprehension? Show an example.",
    "How do I check if a key exists in a Python dictionary?",
    "What is recursion? Show a simple example in Python.",
    "How do I sort a list of numbers in descending order in Python?",
    "What does `*args` mean in a Python function definition?",
    "How do I convert a string to an integer in Python?",
    "What is an exception in Python and how do I catch one?",
    "Write a SQL query that selects all users older than 30 from a table called users.",
    "Write a SQL query that counts the orders per customer in a table called orders.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "Write a JavaScript function that returns the largest number in an array.",
    "How do I create a virtual environment in Python?",
    "What is the time complexity of binary search, and why?",
    "Write a Python class `Stack` with push, pop and is_empty methods.",
    "Write a Python class `BankAccount` with deposit and withdraw methods.",
    "Write a Python script that prints the multiplication table from 1 to 10.",
    "Write a Python program that asks for the user's name and greets them.",
    "Write a unit test with pytest for a function `add(a, b)` that adds two numbers.",
]

# ----------------------------------------------------------------------------- math

NAMES = ["Tom", "Anna", "Sam", "Maria", "Leo", "Priya", "Omar", "Lena", "Ken", "Sofia", "Ivan", "Mei"]
ITEMS = ["apples", "marbles", "books", "stickers", "pencils", "cookies", "coins", "stamps"]


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """A word problem and its worked answer (the answer is used as an earlier assistant turn)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 9)
    kind = rng.randrange(9)
    if kind == 0:
        return (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
                f"{name} has {a} + {b} = {a + b} {item}.")
    if kind == 1:
        a = a + b
        return (f"{name} had {a} {item} and gave {b} to a friend. How many are left?",
                f"{a} - {b} = {a - b}, so {name} has {a - b} {item} left.")
    if kind == 2:
        return (f"A box holds {c} {item}. How many {item} are in {b} boxes?",
                f"{b} boxes x {c} {item} = {b * c} {item}.")
    if kind == 3:
        total = b * c
        return (f"{name} shares {total} {item} equally among {c} friends. How many does each friend get?",
                f"{total} / {c} = {b}, so each friend gets {b} {item}.")
    if kind == 4:
        price = rng.randint(2, 12)
        return (f"One notebook costs ${price}. How much do {c} notebooks cost?",
                f"{c} x ${price} = ${c * price}.")
    if kind == 5:
        speed, hours = rng.randint(30, 90), rng.randint(2, 6)
        return (f"A train travels at {speed} km per hour for {hours} hours. How far does it go?",
                f"Distance = speed x time = {speed} x {hours} = {speed * hours} km.")
    if kind == 6:
        start, dur = rng.randint(6, 10), rng.randint(2, 5)
        end = start + dur
        when = f"{end} pm" if end < 12 else "midnight" if end == 12 else f"{end - 12} am"
        return (f"A movie starts at {start} pm and lasts {dur} hours. When does it end?",
                f"{start} pm + {dur} hours = {when}.")
    if kind == 7:
        w, h = rng.randint(3, 15), rng.randint(3, 15)
        return (f"A rectangle is {w} cm wide and {h} cm tall. What are its area and perimeter?",
                f"Area = {w} x {h} = {w * h} square cm; perimeter = 2 x ({w} + {h}) = {2 * (w + h)} cm.")
    x, y, z = rng.randint(50, 99), rng.randint(50, 99), rng.randint(50, 99)
    return (f"{name} scored {x}, {y} and {z} on three tests. What is the average score?",
            f"({x} + {y} + {z}) / 3 = {x + y + z} / 3 = {round((x + y + z) / 3, 2)}.")


def _algebra(rng: random.Random) -> tuple[str, str]:
    x, a, b = rng.randint(-9, 12), rng.randint(2, 9), rng.randint(1, 30)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"Solve for x: {a}x + {b} = {a * x + b}",
                f"Subtract {b}: {a}x = {a * x}. Divide by {a}: x = {x}.")
    if kind == 1:
        return (f"Solve the equation {a}x - {b} = {a * x - b}.",
                f"Add {b}: {a}x = {a * x}. Divide by {a}: x = {x}.")
    if kind == 2:
        r1, r2 = rng.randint(-6, 6), rng.randint(-6, 6)
        s, p = -(r1 + r2), r1 * r2
        poly = "x^2" + (f" + {s}x" if s > 0 else f" - {-s}x" if s < 0 else "") + \
            (f" + {p}" if p > 0 else f" - {-p}" if p < 0 else "")
        return (f"Solve {poly} = 0.", f"It factors as (x - {r1})(x - {r2}) = 0, so x = {r1} or x = {r2}.")
    return (f"If y = {a}x + {b}, what is y when x = {x}?", f"y = {a} x {x} + {b} = {a * x + b}.")


def _arithmetic(rng: random.Random) -> str:
    kind = rng.randrange(7)
    a, b = rng.randint(12, 999), rng.randint(2, 99)
    if kind == 0:
        return f"What is {a} + {b} * {rng.randint(2, 9)}?"
    if kind == 1:
        return f"What is {rng.choice([10, 15, 20, 25, 30, 40, 50, 75])}% of {rng.randint(2, 40) * 10}?"
    if kind == 2:
        p, q = rng.randint(1, 5), rng.randint(2, 7)
        return f"Add the fractions {p}/{q} and 1/{rng.randint(2, 6)}."
    if kind == 3:
        return f"How many minutes are there in {rng.randint(2, 12)} hours and {rng.randint(5, 55)} minutes?"
    if kind == 4:
        return f"Is {rng.randint(20, 200)} a prime number? Explain how you check."
    if kind == 5:
        return f"Round {rng.randint(100, 9999)}.{rng.randint(10, 99)} to the nearest ten."
    return f"What is the square root of {rng.randint(2, 30) ** 2}?"


MATH_CONCEPTS = [
    "What is a prime number?", "Explain what a fraction is with an example.",
    "What is the Pythagorean theorem?", "How do you calculate the area of a circle?",
    "What is the difference between mean, median and mode?", "What is a percentage?",
    "Explain what a negative number is.", "How do you convert a fraction to a decimal?",
    "What is an equation?", "Why can't you divide by zero?",
]

# ----------------------------------------------------------------------------- writing

RECIPIENTS = ["my manager", "a teacher", "a coworker", "my landlord", "a customer", "a friend", "the team"]
EMAIL_PURPOSES = [
    "asking for a day off next Friday", "thanking them for their help with a project",
    "saying I will be late to the meeting", "asking to reschedule our call to Thursday",
    "announcing that the office will be closed on Monday", "asking about the status of my order",
    "inviting them to a small birthday party", "apologizing for a missed deadline",
    "reporting that the heating in my apartment is broken", "welcoming a new member to the team",
]
CHARACTERS = ["a small robot", "a curious cat", "an old fisherman", "a young wizard", "a lost dog",
              "a girl who loves maths", "a dragon afraid of fire", "a lighthouse keeper", "two friends",
              "a baker"]
EVENTS = ["finds a mysterious map", "learns to swim", "gets lost in a big city", "makes a new friend",
          "discovers a hidden door", "wins a contest", "has to fix a broken machine", "travels to the moon"]
POEM_TOPICS = ["the sea", "autumn leaves", "a rainy morning", "the moon", "coffee", "a city at night",
               "friendship", "a mountain", "spring", "learning to code"]
PARAGRAPHS = [
    "The city council voted on Tuesday to build a new public library downtown. The library will have "
    "a children's section, study rooms and a small cafe. Construction starts next spring and should "
    "take two years.",
    "Honeybees communicate through a 'waggle dance'. By moving in a figure-eight pattern, a bee tells "
    "others the direction and distance of flowers. The angle of the dance shows the direction relative "
    "to the sun.",
    "Our team finished the first version of the app last week. Users can now create accounts and save "
    "notes. Next month we will add search and a dark mode, and fix the slow start-up on older phones.",
    "Regular walking has many health benefits. It strengthens the heart, improves mood and helps with "
    "sleep. Experts suggest about thirty minutes of walking on most days of the week.",
    "The Great Wall of China was built over many centuries to protect against invasions. It is not a "
    "single wall but a series of walls and forts. Much of what stands today was built during the Ming "
    "dynasty.",
    "Python is a popular programming language known for its readable syntax. It is used for web "
    "development, data analysis, automation and machine learning, and has a large community.",
    "The meeting has been moved from Monday to Wednesday at 10 am because several people are traveling. "
    "Please bring the sales report and your ideas for the summer campaign.",
    "Volcanoes form where molten rock from inside the Earth reaches the surface. Some erupt explosively, "
    "while others release lava slowly. Volcanic soil is often very fertile.",
    "Recycling reduces the amount of waste sent to landfills and saves raw materials. Paper, glass and "
    "many plastics can be recycled, but they must be clean and sorted correctly.",
    "The new phone has a larger screen, a better camera and a battery that lasts two days. It costs "
    "slightly more than last year's model and comes in three colors.",
]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a small desk lamp", "a hiking backpack",
            "a coffee grinder", "a kids' science kit", "a plant-based cookbook", "a folding bicycle"]
WRITING_ASKS = [
    lambda r: f"Write a short email to {r.choice(RECIPIENTS)} {r.choice(EMAIL_PURPOSES)}.",
    lambda r: f"Write a polite, brief email to {r.choice(RECIPIENTS)} {r.choice(EMAIL_PURPOSES)}.",
    lambda r: f"Write a short story about {r.choice(CHARACTERS)} who {r.choice(EVENTS)}.",
    lambda r: f"Tell me a five-sentence story about {r.choice(CHARACTERS)} who {r.choice(EVENTS)}.",
    lambda r: f"Write a four-line poem about {r.choice(POEM_TOPICS)}.",
    lambda r: f"Write a haiku about {r.choice(POEM_TOPICS)}.",
    lambda r: f"Summarize the following text in one sentence:\n\n{r.choice(PARAGRAPHS)}",
    lambda r: f"Give me three bullet points that summarize this:\n\n{r.choice(PARAGRAPHS)}",
    lambda r: f"Write a short product description for {r.choice(PRODUCTS)}.",
    lambda r: f"Write a catchy slogan for {r.choice(PRODUCTS)}.",
    lambda r: f"Write a thank-you note to {r.choice(RECIPIENTS)} for a thoughtful gift.",
    lambda r: f"Rewrite this sentence to sound more formal: \"{r.choice(INFORMAL)}\"",
    lambda r: f"Write a short, friendly text message {r.choice(EMAIL_PURPOSES)}.",
]
INFORMAL = ["hey, can u send me the file asap?", "sorry, gonna be late, traffic is crazy",
            "the meeting was kinda pointless tbh", "thx for the help, u saved me", "can we move our chat to tmrw?"]

# ----------------------------------------------------------------------------- explanations

SCIENCE = ["why the sky is blue", "how rainbows form", "why we have seasons", "how plants make food",
           "what gravity is", "how vaccines work", "why ice floats on water", "what causes thunder",
           "how the heart pumps blood", "what DNA is", "why the moon has phases", "how magnets work",
           "what an atom is", "how sound travels", "why leaves change color in autumn", "what a black hole is",
           "how clouds form", "what evaporation is", "why the ocean is salty", "how earthquakes happen"]
THINGS = ["a refrigerator", "the internet", "a microwave oven", "a bicycle's gears", "a solar panel",
          "a GPS receiver", "an electric motor", "a computer's memory", "a compass", "a camera",
          "a search engine", "a battery", "an airplane wing", "a thermostat", "a password manager"]
HISTORY = ["the printing press", "the Roman Empire", "the Industrial Revolution", "the first Moon landing",
           "ancient Egypt's pyramids", "the invention of the telephone", "the Renaissance",
           "the fall of the Berlin Wall", "the Silk Road", "the invention of writing"]
PEOPLE = ["Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Albert Einstein",
          "Charles Darwin", "Nelson Mandela", "Galileo Galilei", "Alan Turing", "Cleopatra"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("RAM", "storage"),
         ("a meteor", "a comet"), ("mass", "weight"), ("a democracy", "a monarchy"), ("an alloy", "a compound"),
         ("HTTP", "HTTPS"), ("a lake", "a sea")]
EXPLAIN_ASKS = [
    lambda r: f"Explain {r.choice(SCIENCE)} in simple terms.",
    lambda r: f"Can you explain {r.choice(SCIENCE)} to a ten-year-old?",
    lambda r: f"In a few sentences, explain {r.choice(SCIENCE)}.",
    lambda r: f"How does {r.choice(THINGS)} work?",
    lambda r: f"Explain briefly how {r.choice(THINGS)} works.",
    lambda r: f"Why was {r.choice(HISTORY)} important?",
    lambda r: f"Give a short overview of {r.choice(HISTORY)}.",
    lambda r: f"Who was {r.choice(PEOPLE)} and why are they famous?",
    lambda r: "What is the difference between {} and {}?".format(*r.choice(PAIRS)),
]

# ----------------------------------------------------------------------------- multi-turn

CODE_FOLLOWUPS = ["Now add type hints to it.", "Can you make it handle an empty list or empty input?",
                  "Write a pytest test for it.", "Explain how it works line by line.",
                  "Can you make it shorter?", "What is its time complexity?",
                  "Add a docstring with an example.", "How would I call it from the command line?"]
EXPLAIN_PAIRS = [
    ("Why is the sky blue?",
     "Sunlight contains all colors. Air molecules scatter short blue wavelengths much more than red ones, "
     "so blue light reaches our eyes from every direction of the sky."),
    ("What is photosynthesis?",
     "Photosynthesis is how plants make food. They use sunlight to turn water and carbon dioxide into "
     "sugar, and release oxygen."),
    ("How does a refrigerator keep food cold?",
     "A refrigerator pumps a refrigerant through pipes. It evaporates inside, absorbing heat from the food, "
     "and releases that heat outside through the coils at the back."),
    ("What is gravity?",
     "Gravity is the force that pulls objects with mass toward each other. It keeps us on the ground and "
     "keeps the Moon in orbit around the Earth."),
    ("What causes the seasons?",
     "The Earth's axis is tilted. As the Earth orbits the Sun, each hemisphere is tilted toward the Sun for "
     "part of the year (summer) and away from it for another part (winter)."),
    ("What is an API?",
     "An API (application programming interface) is a set of rules that lets one program ask another for "
     "data or actions, like a menu of requests it understands."),
    ("What is a variable in programming?",
     "A variable is a name that refers to a value stored in memory, such as `age = 12`. You can read it and "
     "change it later in the program."),
    ("How do vaccines work?",
     "A vaccine shows the immune system a harmless piece or copy of a germ. The body learns to recognize it, "
     "so it can fight the real germ quickly later."),
    ("Who invented the printing press?",
     "Johannes Gutenberg built a printing press with movable metal type around 1440 in Mainz, Germany."),
    ("What is the water cycle?",
     "Water evaporates from oceans and lakes, condenses into clouds, falls as rain or snow, and flows back "
     "to the sea in rivers and underground."),
]
EXPLAIN_FOLLOWUPS = ["Can you explain it to a five-year-old?", "Give me an example.",
                     "Can you say that in one sentence?", "Why does that matter in everyday life?",
                     "What is a common misconception about this?"]
MATH_FOLLOWUPS = ["Can you explain each step?", "How can I check that the answer is right?",
                  "Can you write a similar problem for me to practice?", "Now do the same with bigger numbers."]
# (request, reply, a follow-up request, a reply to it)
WRITING_PAIRS = [
    ("Write a one-sentence email asking my manager for Friday off.",
     "Hi Sarah, could I please take this Friday off for a personal appointment? Thank you!",
     "Make it more formal.",
     "Dear Ms. Lee, I would like to request leave this Friday for a personal appointment. Kind regards, Tom"),
    ("Write a two-line poem about the sea.",
     "The sea keeps time with silver waves,\nand sings the moon to sleep.",
     "Make it about a storm instead.",
     "The sea throws thunder at the shore,\nand the gulls go quiet."),
    ("Suggest a name for a small coffee shop.", "How about \"The Daily Grind\"?",
     "Give me two other options.", "1. \"Bean There\"\n2. \"The Corner Cup\""),
    ("Write a short tweet announcing our new app.",
     "Our new app is here! Take notes, set reminders and stay organized. Download it today.",
     "Make it shorter.", "Our new app is here: notes and reminders in one place. Try it today!"),
    ("Give me a title for a story about a lost robot.", "\"Finding Home: The Journey of Bolt\"",
     "Make it sound scarier.", "\"Bolt Alone in the Dark\""),
]
WRITING_FOLLOWUPS = ["Make it more formal.", "Make it shorter.", "Make it funnier.",
                     "Give me two other versions.", "Can you make it sound more friendly?"]


# ----------------------------------------------------------------------------- assembly


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def build(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    items: list[tuple[str, list[dict]]] = []
    seen: set[str] = set()

    def add(category, messages):
        key = json.dumps(messages)
        if key not in seen:
            seen.add(key)
            items.append((category, messages))

    for name, what, _ in FUNCTIONS:  # every function at least twice, in different words
        for ask in rng.sample(FUNCTION_ASKS, 2):
            add("code", [_user(ask.format(name=name, what=what))])
    for code, goal in BUGS:
        add("code", [_user(rng.choice(BUG_ASKS).format(code=code, goal=goal))])
    for code in SNIPPETS:
        add("code", [_user(rng.choice(SNIPPET_ASKS).format(code=code))])
    for q in CODE_QUESTIONS:
        add("code", [_user(q)])

    while sum(c == "math" for c, _ in items) < 100:
        kind = rng.randrange(3)
        q = _word_problem(rng)[0] if kind == 0 else _algebra(rng)[0] if kind == 1 else _arithmetic(rng)
        add("math", [_user(q)])
    for q in MATH_CONCEPTS:
        add("math", [_user(q)])

    while sum(c == "writing" for c, _ in items) < 90:
        add("writing", [_user(rng.choice(WRITING_ASKS)(rng))])
    while sum(c == "explanation" for c, _ in items) < 100:
        add("explanation", [_user(rng.choice(EXPLAIN_ASKS)(rng))])

    for name, what, code in rng.sample(FUNCTIONS, 24):
        first = rng.choice(FUNCTION_ASKS).format(name=name, what=what)
        answer = f"Here is a simple version:\n\n```python\n{code}\n```"
        add("multi_turn", [_user(first), _assistant(answer), _user(rng.choice(CODE_FOLLOWUPS))])
    for q, a in EXPLAIN_PAIRS:
        for follow in rng.sample(EXPLAIN_FOLLOWUPS, 2):
            add("multi_turn", [_user(q), _assistant(a), _user(follow)])
    for _ in range(14):
        q, a = _word_problem(rng) if rng.random() < 0.6 else _algebra(rng)
        add("multi_turn", [_user(q), _assistant(a), _user(rng.choice(MATH_FOLLOWUPS))])
    for q, a, follow, rewrite in WRITING_PAIRS:
        add("multi_turn", [_user(q), _assistant(a), _user(rng.choice(WRITING_FOLLOWUPS))])
        add("multi_turn", [_user(q), _assistant(a), _user(follow), _assistant(rewrite),
                           _user(rng.choice(["Thanks! One more version, please.", "Perfect. Now translate it "
                                             "into simple English for a child.", "Can you explain why you "
                                             "chose those words?"]))])

    records = _shuffled_records(items, rng, "", 3)
    # The completion prompts come last, with their own random stream: the records before them (and
    # so every prefix the tests take, data.max_samples=N) are those of the set before they existed.
    crng = random.Random(seed + 7)
    done = {json.dumps(r["messages"]) for r in records}
    completions = [("code_completion", [_user(ask.format(stub=stub))])  # each stub twice, in two wordings
                   for _, stub in completion_stubs() for ask in crng.sample(COMPLETION_ASKS, 2)]
    completions = [c for c in completions if json.dumps(c[1]) not in done]
    return records + _shuffled_records(completions, crng, "", 3)


def _shuffled_records(items: list, rng: random.Random, prefix: str, width: int) -> list[dict]:
    """(category, messages) items shuffled, as records with ids numbered per category."""
    rng.shuffle(items)
    counters: dict[str, int] = {}
    out = []
    for category, messages in items:
        counters[category] = counters.get(category, 0) + 1
        out.append({"id": f"{prefix}{category}-{counters[category]:0{width}d}", "category": category,
                    "messages": messages})
    return out


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


# ----------------------------------------------------------------------------- large mode

LARGE_SIZE = 20000
LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby", "Kotlin"]
MORE_FUNCTIONS = [
    "returns the number of words in a sentence", "checks whether two strings are anagrams",
    "returns the greatest common divisor of two integers", "converts a number of seconds to hours, minutes and seconds",
    "returns every prime number below n", "counts how many times a character appears in a string",
    "checks whether a year is a leap year", "returns the median of a list of numbers",
    "capitalizes the first letter of every word in a string", "returns the list of digits of an integer",
    "checks whether a list is sorted", "rotates a list by k positions", "returns the intersection of two lists",
    "converts a binary string to a decimal number", "converts a decimal number to binary",
    "removes all whitespace from a string", "returns the longest word in a sentence",
    "splits a list into chunks of size n", "returns the running total of a list of numbers",
    "checks whether a string contains only digits", "returns the n-th row of Pascal's triangle",
    "computes the dot product of two vectors", "transposes a matrix given as a list of lists",
    "validates that a string looks like an email address", "returns the most common element of a list",
    "reverses the order of words in a sentence", "computes compound interest", "checks whether brackets in a string are balanced",
    "converts a string to title case", "returns the index of an item in a sorted list using binary search",
    "sums the even numbers in a list", "counts the lines in a text file", "returns the average word length of a text",
    "removes vowels from a string", "returns the squares of a list of numbers", "finds the smallest missing positive integer",
    "merges two dictionaries", "groups a list of words by their first letter", "returns the factorial of n recursively",
    "checks whether a number is a perfect square",
]
HOWTO_TASKS = [
    "read a file line by line", "sort a list of objects by a field", "make an HTTP GET request", "parse JSON",
    "write to a CSV file", "handle errors", "define a class with a constructor", "loop over a dictionary",
    "format a date as YYYY-MM-DD", "generate a random number", "check if a string starts with a prefix",
    "remove duplicates from an array", "concatenate strings", "measure how long a piece of code takes",
    "read an environment variable", "split a string by commas", "write a unit test", "create a thread",
    "reverse an array", "find the maximum of an array",
]
CODE_EXTRAS = [".", ". Add comments.", ", and explain its time complexity.", ", with a few tests.",
               ", without using library helpers.", ", and show an example call."]
MORE_TOPICS = [
    "how a compiler works", "what machine learning is", "how encryption keeps messages private", "what inflation is",
    "how a bank loan works", "what photosynthesis is", "how the immune system works", "what climate change is",
    "how a vaccine is tested", "how electricity reaches a home", "what a neural network is", "how tides work",
    "what an operating system does", "how a hash table works", "what version control is", "how email is delivered",
    "what a database index is", "how recycling works", "what supply and demand means", "how bees make honey",
    "what a budget is", "how a rocket reaches orbit", "what the water cycle is", "how memory works in the brain",
    "what a cell is", "how a web browser shows a page", "what compound interest is", "how wind turbines work",
    "what an ecosystem is", "how sleep helps the body",
]
EXPLAIN_FORMATS = ["in one paragraph", "in three bullet points", "with an everyday example", "in simple words"]
WRITING_TONES = ["short", "formal", "friendly", "very polite", "brief and clear"]
STORY_KINDS = ["short story", "five-sentence story", "funny story", "bedtime story for a child", "mystery story"]
AUDIENCES = ["a ten-year-old", "a high-school student", "a beginner", "someone who has never heard of it",
             "a busy manager", "an engineer"]
EXPLAIN_STYLES = [
    "Explain {topic} to {audience}.", "Explain {topic} in three bullet points.", "Explain {topic} in one paragraph.",
    "Give a simple analogy for {topic}.", "What are the key ideas behind {topic}?",
    "Write a short quiz question about {topic} and answer it.",
]
STDLIB_MODULES = ["json", "os.path", "itertools", "collections", "functools", "re", "math", "statistics", "string",
                  "textwrap", "datetime", "random", "pathlib", "shutil", "csv", "heapq", "bisect", "operator",
                  "time", "glob", "fnmatch", "difflib", "unicodedata", "base64", "hashlib", "zlib", "copy",
                  "pprint", "enum", "dataclasses", "contextlib", "argparse", "logging", "decimal", "fractions"]
STDLIB_ASKS = ["What does `{name}` do in Python? Give a short example.",
               "How do I use `{name}` in Python? Show an example.",
               "Explain the Python function `{name}` and when to use it."]


def stdlib_functions() -> list:
    """Public functions and classes of STDLIB_MODULES that have a docstring, as dotted names."""
    import importlib
    import inspect

    names = []
    for mod_name in STDLIB_MODULES:
        mod = importlib.import_module(mod_name)
        public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for n in sorted(set(public)):
            obj = getattr(mod, n, None)
            if (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)) and inspect.getdoc(obj):
                names.append(f"{mod_name}.{n}")
    return names


def build_large(size: int = LARGE_SIZE, seed: int = SEED + 1) -> list[dict]:
    """``size`` distinct conversations (or fewer if the templates run out, which they do not below
    ~100k: maths is unbounded), categories mixed as in the small set plus ``docs``."""
    rng = random.Random(seed)
    pools: dict[str, list] = {c: [] for c in ("code", "math", "writing", "explanation", "docs", "multi_turn")}
    whats = [what for _, what, _ in FUNCTIONS] + MORE_FUNCTIONS
    for what in whats:
        for lang in LANGUAGES:
            pools["code"] += [[_user(f"Write a {lang} function that {what}{extra}")] for extra in CODE_EXTRAS]
        for ask in FUNCTION_ASKS:
            pools["code"].append([_user(ask.format(name="solution", what=what).replace("`solution` ", ""))])
    for task in HOWTO_TASKS:
        for lang in LANGUAGES:
            pools["code"].append([_user(f"How do I {task} in {lang}?")])
    for code, goal in BUGS:
        pools["code"] += [[_user(a.format(code=code, goal=goal))] for a in BUG_ASKS]
    for code in SNIPPETS:
        pools["code"] += [[_user(a.format(code=code))] for a in SNIPPET_ASKS]
    pools["code"] += [[_user(q)] for q in CODE_QUESTIONS]
    topics = (list(SCIENCE) + MORE_TOPICS + [f"how {t} works" for t in THINGS] + [f"the importance of {h}" for h in HISTORY]
              + [f"the work of {p}" for p in PEOPLE] + ["the difference between {} and {}".format(*p) for p in PAIRS])
    for topic in topics:
        for style in EXPLAIN_STYLES:
            for audience in AUDIENCES if "{audience}" in style else [None]:
                pools["explanation"].append([_user(style.format(topic=topic, audience=audience))])
        for audience in AUDIENCES:
            for fmt in EXPLAIN_FORMATS:
                pools["explanation"].append([_user(f"Explain {topic} to {audience}, {fmt}.")])
    for recipient in RECIPIENTS:
        for purpose in EMAIL_PURPOSES:
            pools["writing"] += [[_user(f"Write a {tone} email to {recipient} {purpose}.")] for tone in WRITING_TONES]
    for who in CHARACTERS:
        for event in EVENTS:
            pools["writing"] += [[_user(f"Write a {kind} about {who} who {event}.")] for kind in STORY_KINDS]
    for topic in POEM_TOPICS:
        pools["writing"] += [[_user(f"Write a {form} about {topic}.")] for form in
                             ("haiku", "four-line poem", "limerick", "short song", "two-sentence story")]
    for text in PARAGRAPHS:
        pools["writing"] += [[_user(f"{ask}\n\n{text}")] for ask in
                             ("Summarize the following text in one sentence:", "Give me three bullet points that summarize this:",
                              "Write a title for this text:", "Rewrite this text for a child:", "List the key facts in this text:")]
    for product in PRODUCTS:
        pools["writing"] += [[_user(f"Write a {kind} for {product}.")] for kind in
                             ("short product description", "catchy slogan", "customer review", "tweet")]
    pools["writing"] += [[_user(f"Rewrite this sentence to sound more formal: \"{t}\"")] for t in INFORMAL]
    for name in stdlib_functions():
        pools["docs"] += [[_user(a.format(name=name))] for a in STDLIB_ASKS]
    for name, what, code in FUNCTIONS:
        for follow in CODE_FOLLOWUPS:
            answer = f"Here is a simple version:\n\n```python\n{code}\n```"
            pools["multi_turn"].append([_user(f"Write a Python function `{name}` that {what}."), _assistant(answer),
                                        _user(follow)])
    for q, a in EXPLAIN_PAIRS:
        pools["multi_turn"] += [[_user(q), _assistant(a), _user(f)] for f in EXPLAIN_FOLLOWUPS]
    # maths: unbounded (random numbers); single questions and worked answers with a follow-up
    shares = {"code": 0.24, "math": 0.20, "writing": 0.14, "explanation": 0.18, "docs": 0.08, "multi_turn": 0.16}
    want = {c: int(size * f) for c, f in shares.items()}
    want["math"] += size - sum(want.values())
    seen: set[str] = set()
    items: list[tuple[str, list]] = []

    def add(category, messages) -> bool:
        key = json.dumps(messages)
        if key in seen:
            return False
        seen.add(key)
        items.append((category, messages))
        return True

    for category, pool in pools.items():
        rng.shuffle(pool)
        for messages in pool[: want[category]]:
            add(category, messages)
    tries = 0
    while len(items) < size and tries < 50 * size:  # maths (and maths multi-turn) fill the rest
        tries += 1
        if rng.random() < 0.25:
            q, a = _word_problem(rng) if rng.random() < 0.6 else _algebra(rng)
            add("multi_turn", [_user(q), _assistant(a), _user(rng.choice(MATH_FOLLOWUPS))])
        else:
            kind = rng.randrange(3)
            add("math", [_user(_word_problem(rng)[0] if kind == 0 else _algebra(rng)[0] if kind == 1 else _arithmetic(rng))])
    return _shuffled_records(items, rng, "large-", 5)


# ----------------------------------------------------------------------------- long context

def build_long_context() -> list[dict]:
    """A few long held-out prompts (export.extra_prompts=builtin:long_context, served by the embedded
    default next to the eval split so that its acceptance by context length has prompts past 512
    tokens): documents assembled from the notes and functions above, each with a task over all of
    it. Never trained on; three, not more: every prompt is served at each k on a 2-core CPU."""
    notes = "\n\n".join(f"Note {i + 1}. {p}" for i, p in enumerate(PARAGRAPHS))
    module = "\n\n\n".join(code for _, _, code in FUNCTIONS)
    short = "\n\n\n".join(code for _, _, code in FUNCTIONS[:8])
    return [
        {"id": "long-notes", "category": "long_context",
         "messages": [_user(f"Here are {len(PARAGRAPHS)} short notes and a few Python functions.\n\n{notes}\n\n"
                            f"```python\n{short}\n```\n\nSummarize each note in one sentence, in order, as a "
                            f"numbered list; then say which function could count the words of a note.")]},
        {"id": "long-module", "category": "long_context",
         "messages": [_user(f"Here is a Python module.\n\n```python\n{module}\n```\n\nList every function in "
                            f"this module with one line saying what it does.")]},
        {"id": "long-both", "category": "long_context",
         "messages": [_user(f"Read these notes.\n\n{notes}\n\nNow read this Python module.\n\n```python\n"
                            f"{module}\n```\n\nWrite a Python function that takes the text of one note and "
                            f"returns its most common word, using functions from the module where they help.")]},
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if prompts.jsonl differs from a fresh build")
    ap.add_argument("--large", type=int, default=0, metavar="N",
                    help="write N conversations of the large mode to --out instead (prompts.jsonl is untouched)")
    ap.add_argument("--out", type=Path, default=None, help="output file for --large")
    args = ap.parse_args()
    if args.large:
        if args.out is None:
            ap.error("--large needs --out FILE")
        records = build_large(args.large)
        args.out.write_text(render(records))
        counts = collections.Counter(r["category"] for r in records)
        print(f"wrote {len(records)} prompts to {args.out}: {dict(counts)}")
        return
    text = render(build())
    long_text = render(build_long_context())
    if args.check:
        for out, want in ((OUT, text), (LONG_OUT, long_text)):
            if not out.exists() or out.read_text() != want:
                sys.exit(f"{out} is out of date: run python {Path(__file__).name}")
            print(f"{out.name} is up to date")
        return
    OUT.write_text(text)
    LONG_OUT.write_text(long_text)
    counts: dict[str, int] = {}
    for line in text.splitlines():
        category = json.loads(line)["category"]
        counts[category] = counts.get(category, 0) + 1
    print(f"wrote {sum(counts.values())} prompts to {OUT}: {counts}")


if __name__ == "__main__":
    main()
