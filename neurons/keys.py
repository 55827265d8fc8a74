"""Hotkeys for the neurons: development keys for local runs, wallet hotkeys for real ones.

A missing wallet is the most common first-run mistake, so it surfaces as one clear message naming
the file looked for and the ``btcli`` command that creates it, not a stack trace from the keyfile layer.

Example::

    alice = dev_keypair("Alice")            # same as Keypair.create_from_uri("//Alice")
    alice.ss58_address                      # '5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY'
    hot = load_hotkey("miner", "default", "~/.bittensor/wallets")   # raises MissingKeyError if absent
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bittensor as bt
from bittensor.sp_core import KeyfileError, Keypair

DEFAULT_WALLET_PATH = "~/.bittensor/wallets"


class MissingKeyError(KeyError):
    """The wallet's hotkey file does not exist or cannot be read; the message says what to do."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else "missing key"


def dev_keypair(name: str) -> Any:
    """The well-known development key ``//Name`` (``"Alice"`` and ``"//Alice"`` are the same); never for real funds."""
    uri = name if name.startswith("//") else "//" + name
    return Keypair.create_from_uri(uri)


def load_hotkey(wallet_name: str, hotkey: str, path: str | None = None) -> Any:
    """The hotkey Keypair of wallet ``wallet_name`` / ``hotkey`` under ``path``."""
    root = path or DEFAULT_WALLET_PATH
    wallet = bt.Wallet(name=wallet_name, hotkey=hotkey, path=root)
    keyfile = Path(root).expanduser() / wallet_name / "hotkeys" / hotkey
    hint = f"create it with: btcli wallet new-hotkey -w {wallet_name} -H {hotkey} --wallet-path {root}"
    try:
        return wallet.hotkey
    except FileNotFoundError:
        raise MissingKeyError(f"no hotkey '{hotkey}' in wallet '{wallet_name}': {keyfile} does not exist; "
                              f"{hint}") from None
    except (OSError, ValueError, KeyfileError) as e:
        raise MissingKeyError(f"cannot read hotkey '{hotkey}' of wallet '{wallet_name}' at {keyfile}: {e}") from None
