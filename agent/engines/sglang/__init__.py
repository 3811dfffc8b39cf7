"""The SGLang engine adapter: the linker loaded into the server (:mod:`.linker`, the only module that
imports SGLang), its request ledger (:mod:`.ledger`) and the serving client (:mod:`.serve`)."""
