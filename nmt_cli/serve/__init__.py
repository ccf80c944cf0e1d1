"""`nmt serve`: the HTTP app, dynamic batching, request checks, metrics, API keys and the page (page.html). Imports
the root modules, text, model, decode and export."""
