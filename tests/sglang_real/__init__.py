"""The real-SGLang tier: the SGLang 0.5.23 server on the CPU (``tests/sglang_cpu/install.sh``; run in that
virtualenv with ``-m sglang_real``; RP_REQUIRE_SGLANG=1 turns the skip into a failure)."""
