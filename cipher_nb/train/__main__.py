"""`python -m cipher_nb.train`: the `cipher-train` command."""

from .cli import cipher_train

if __name__ == "__main__":
    raise SystemExit(cipher_train())
