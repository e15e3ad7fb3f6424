"""The product's code keeps the shape docs/architecture.md ("Sizes") promises: no source file
over 800 lines, no function over 80, except the tables listed there. Functions are those
defined at the start of a line and closed by a `}` at the start of a line, which is how every
out-of-line definition here is formatted; what a class defines inline is not measured."""

import os
import re
import unittest

SOURCE = os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
PRODUCT = ["agent", "contracts", "launcher", "metrics", "rendezvous", "worker_sdk/src", "worker_sdk/include"]
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
# docs/architecture.md, "Sizes": option and help tables.
FUNCTION_EXCEPTIONS = {("launcher/options.cpp", "help_text")}
NOT_A_FUNCTION = re.compile(r"^(namespace|struct|class|enum|union|using|template|extern|static_assert|typedef)\b")


def product_files():
    for top in PRODUCT:
        for root, _, names in os.walk(os.path.join(SOURCE, top)):
            for name in sorted(names):
                if name.endswith((".cpp", ".h")):
                    path = os.path.join(root, name)
                    yield os.path.relpath(path, SOURCE), path


def functions(lines):
    """(name, first line, length) of each function defined at the start of a line."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line and not line[0].isspace() and "(" in line and not line.startswith(("}", "#", "/", "*")) \
                and not NOT_A_FUNCTION.match(line):
            # The signature may go on over indented lines; it ends with `{` (a definition) or `;`.
            def code(k):
                return re.sub(r"//.*", "", lines[k]).rstrip()

            j = i
            while j < len(lines) and not code(j).endswith(("{", ";", "}")):
                j += 1
            if j < len(lines) and code(j).endswith("{"):
                end = j + 1
                while end < len(lines) and lines[end].rstrip() != "}":
                    end += 1
                name = re.search(r"([\w:~]+)\s*\(", line)
                yield (name.group(1) if name else line.strip()), i + 1, end - i + 1
                i = end
        i += 1


class CodeShape(unittest.TestCase):
    def test_no_product_source_file_is_over_800_lines(self):
        over = []
        for rel, path in product_files():
            with open(path, encoding="utf-8") as f:
                n = len(f.read().splitlines())
            if n > MAX_FILE_LINES:
                over.append(f"{rel}: {n} lines")
        self.assertEqual(over, [], "split these files (docs/architecture.md, Sizes)")

    def test_no_product_function_is_over_80_lines_but_the_listed_tables(self):
        over = []
        measured = 0
        for rel, path in product_files():
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
            for name, first, length in functions(lines):
                measured += 1
                short = name.split("::")[-1]
                if length > MAX_FUNCTION_LINES and (rel, short) not in FUNCTION_EXCEPTIONS:
                    over.append(f"{rel}:{first}: {name}, {length} lines")
        self.assertGreater(measured, 500, "the scan found too few functions to be measuring anything")
        self.assertEqual(over, [], "split these functions, or list a table in docs/architecture.md, Sizes")

    def test_the_measure_finds_a_long_function(self):
        body = ["int f(int a,", "      int b) {"] + ["  ++a;"] * 90 + ["}", "", "void g() {", "}"]
        found = list(functions(body))
        self.assertEqual([(n, first) for n, first, _ in found], [("f", 1), ("g", 95)])
        self.assertEqual(found[0][2], 93)


if __name__ == "__main__":
    unittest.main()
