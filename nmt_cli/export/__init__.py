"""Other projects' formats: CTranslate2 and Transformers exports, Transformers imports, and the choice of engine
for a model path. Imports the root modules, text, model and decode."""
