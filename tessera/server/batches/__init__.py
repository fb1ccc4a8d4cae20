"""OpenAI's Files and Batch API: protocol.py (shapes, input checks, limits), store.py (SQLite in
$TESSERA_HOME), runner.py (lines through the server's own app at background priority), router.py."""
