"""Stage 2: Delta ``samples`` → Delta ``tokenized`` + ``tokenize_quarantine``.

Ids, labels and media spans per model profile (chat format, vision tokens).
"""
