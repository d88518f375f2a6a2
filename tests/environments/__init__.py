"""The environment adapters' tier: each adapter against its real package (verifiers: ``install_verifiers.sh``; run in
that virtualenv with ``-m verifiers``; RP_REQUIRE_VERIFIERS=1 turns the skip into a failure)."""
