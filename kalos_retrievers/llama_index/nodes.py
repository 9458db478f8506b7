"""Node <-> stored row: the one place that decides how a LlamaIndex node is kept in Kalos.

A node becomes one row of its store's namespace:

* id: ``node.node_id``;
* vector: ``node.embedding`` (LlamaIndex computes it before ``add``);
* text: the node's text (vector-only rows for nodes without text);
* metadata: :func:`llama_index.core.vector_stores.utils.node_to_metadata_dict`: the node's own
  metadata at the top level (so filters see it), the serialized node (``_node_content``,
  ``_node_type``), ``ref_doc_id``/``doc_id``/``document_id``, plus ``_node_id`` (so a query can be
  restricted to node ids inside the sidecar).

Reading a row back rebuilds the node from ``_node_content`` with
:func:`~llama_index.core.vector_stores.utils.metadata_dict_to_node`, so the node's metadata,
relationships and id come back as they went in, whatever else the top level holds. A row that
LlamaIndex did not write (the LangChain store's, or ``KalosClient.upsert``'s: no
``_node_content``) comes back as a :class:`~llama_index.core.schema.TextNode` with the row's id,
text and metadata, as other LlamaIndex vector stores read foreign rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llama_index.core.schema import BaseNode, Document, MetadataMode, TextNode
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from .filters import NODE_ID_KEY

__all__ = ["node_to_row", "row_to_node"]


def node_to_row(node: BaseNode, label: str = "node") -> tuple[str, list[float], str, dict[str, Any]]:
    """``(id, vector, text, metadata)`` for one node; ``text`` is ``""`` when it has none.

    Raises:
        ValueError: the node has no embedding (the message names it as ``label (id 'x')``).
    """
    if node.embedding is None:
        raise ValueError(
            f"{label} (id {node.node_id!r}) has no embedding; build nodes through an index (which "
            "embeds them) or set node.embedding before adding it to a KalosVectorStore"
        )
    text = node.get_content(metadata_mode=MetadataMode.NONE) or ""
    # The text travels in the row's text field; the serialized node need not repeat it.
    metadata = node_to_metadata_dict(node, remove_text=bool(text), flat_metadata=False)
    metadata[NODE_ID_KEY] = node.node_id
    return node.node_id, list(node.embedding), text, metadata


def row_to_node(text: str, metadata: Mapping[str, Any], row_id: str | None = None) -> BaseNode:
    """Rebuild a node from a stored row's text, metadata and id (see the module's docstring;
    without ``row_id``, a row LlamaIndex did not write gets a new node id)."""
    if "_node_content" not in metadata:  # a row LlamaIndex did not write
        md = {key: value for key, value in metadata.items() if key != NODE_ID_KEY}
        return TextNode(text=text, metadata=md, **({"id_": row_id} if row_id is not None else {}))
    if metadata.get("_node_type") == Document.class_name():
        # (metadata_dict_to_node knows Node, IndexNode and ImageNode, and reads anything else,
        # a Document included, as a TextNode)
        doc = Document.from_json(metadata["_node_content"])
        if text:
            doc.set_content(text)
        return doc
    return metadata_dict_to_node(dict(metadata), text=text or None)
