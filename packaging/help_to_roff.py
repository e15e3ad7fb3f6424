#!/usr/bin/env python3
"""Writes ddplaunch(1) from `ddplaunch --help`.

`ddplaunch --help` is written as a man page (launcher/options.cpp, help_text()): section titles
in capitals at column 0, subsections at 2 spaces, terms (options, variables, exit codes) and
paragraphs at 4, their text at 8. This turns that layout into man(7) markup, so the installed
page is the help, never a copy that drifts. Run at build time (packaging/CMakeLists.txt);
tests/packaging/test_man_pages.py checks that every flag of --help is in the rendered page.

Usage: help_to_roff.py --program PATH/ddplaunch --version X.Y.Z --date YYYY-MM-DD --output ddplaunch.1
"""
import argparse
import os
import re
import subprocess
import sys

# Sections whose 4-space lines are terms with text below them (.TP), and those kept as typed.
TERM_SECTIONS = {"OPTIONS", "ENVIRONMENT", "EXIT STATUS"}
VERBATIM_SECTIONS = {"SYNOPSIS"}


def escape(text):
    """Plain text as roff: backslashes, dashes (as minus signs, so options copy and paste), and
    a leading period or quote that roff would take for a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    if text.startswith((".", "'")):
        text = "\\&" + text
    return text


def convert(help_text, name, version, date):
    """The man(7) source of `help_text`, the --help of program `name`."""
    out = ['.TH %s 1 "%s" "%s %s" "User Commands"' % (name.upper(), date, name, version)]
    section = None
    block = False      # inside an EXAMPLES command block (8 spaces), kept as typed
    paragraph = False  # a blank line was seen: the next text starts a paragraph
    for line in help_text.splitlines():
        stripped = line.strip()
        depth = len(line) - len(line.lstrip(" "))
        if block and (not stripped or depth < 8):
            out += [".fi", ".RE"]
            block = False
            paragraph = True
        if not stripped:
            paragraph = True
            continue
        if depth == 0:  # a section title
            if section in VERBATIM_SECTIONS:
                out.append(".fi")
            section = stripped
            out.append(".SH " + escape(section))
            if section in VERBATIM_SECTIONS:
                out.append(".nf")
            paragraph = False
            continue
        if section in VERBATIM_SECTIONS:
            out.append(escape(stripped))
        elif section == "OPTIONS" and depth == 2:
            out.append(".SS " + escape(stripped))
        elif section in TERM_SECTIONS and depth == 4:
            # "--flag VALUE" alone, or "CODE   text" on one line (EXIT STATUS)
            term, text = _split_term(stripped)
            out += [".TP", "\\fB%s\\fR" % escape(term)]
            if text:
                out.append(escape(text))
        elif section == "EXAMPLES" and depth >= 8:
            if not block:
                out += [".RS 4", ".nf"]
                block = True
            out.append(escape(line[8:].rstrip()))  # continuation lines keep their alignment
        else:
            if paragraph and section not in TERM_SECTIONS:
                out.append(".PP")
            out.append(escape(stripped))
        paragraph = False
    if block:
        out += [".fi", ".RE"]
    if section in VERBATIM_SECTIONS:
        out.append(".fi")
    return "\n".join(out) + "\n"


def _split_term(line):
    """("0", "the job succeeded ...") for "0      the job succeeded ...", else (line, "")."""
    parts = re.split(r"\s{2,}", line, maxsplit=1)
    return (parts[0], parts[1]) if len(parts) == 2 else (line, "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--date", required=True, help="YYYY-MM-DD for the page's header")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    proc = subprocess.run([args.program, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    if proc.returncode != 0:
        sys.exit("help_to_roff: %s --help exited %d: %s" % (args.program, proc.returncode, proc.stderr))
    page = convert(proc.stdout, os.path.basename(args.program), args.version, args.date)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, args.output)


if __name__ == "__main__":
    main()
