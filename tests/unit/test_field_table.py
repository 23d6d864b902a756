"""The request-field table in docs/serving.md is the one the request models generate (field_table.py), so
a field added, refused or dropped in the models shows in the doc."""
import re

from docs_text import read
from fixtures import require_server_extras

require_server_extras()

from livemoe.engine.server.field_table import ENDPOINTS, table  # noqa: E402


def test_the_docs_table_is_the_generated_one():
    doc = read("docs/serving.md")
    found = re.search(r"<!-- field-table:start -->\n(.*?)\n<!-- field-table:end -->", doc, re.S)
    assert found, "docs/serving.md has no field table"
    assert found.group(1) == table(), "regenerate it: python -m livemoe.engine.server.field_table"


def test_every_field_of_every_endpoint_has_a_row():
    rows = {line.split("|")[1].strip(" `") for line in table().splitlines()[2:]}
    for model in ENDPOINTS.values():
        assert set(model.model_fields) - {"schema_"} <= rows
