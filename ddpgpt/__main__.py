"""`python -m ddpgpt ...` and `torchrun -m ddpgpt train ...` both land here."""

from ddpgpt.cli import main

if __name__ == "__main__":
    main()
