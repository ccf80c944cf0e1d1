"""Raw text <-> pieces <-> ids: Moses tokenization, joint BPE, SentencePiece, the shared vocabulary, language
traits. Imports only the root modules (errors, textio)."""
