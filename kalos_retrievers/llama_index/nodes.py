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

import json
from collections.abc import Mapping
from typing import Any

from llama_index.core.schema import BaseNode, Document, ImageDocument, MetadataMode, Node, TextNode
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
    resource = getattr(node, "text_resource", None)  # (a Node's, a Document's: MediaResource)
    if text and resource is not None and resource.model_dump(exclude={"text"}, exclude_none=True):
        # remove_text drops the whole text_resource, its path, url and mimetype with the
        # text: keep them (the text comes back from the row's field, as above)
        content = json.loads(metadata["_node_content"])
        content["text_resource"] = {**resource.model_dump(mode="json"), "text": None}
        metadata["_node_content"] = json.dumps(content, ensure_ascii=False)
    metadata[NODE_ID_KEY] = node.node_id
    return node.node_id, list(node.embedding), text, metadata


def row_to_node(text: str, metadata: Mapping[str, Any], row_id: str | None = None) -> BaseNode:
    """Rebuild a node from a stored row's text, metadata and id (see the module's docstring;
    without ``row_id``, a row LlamaIndex did not write gets a new node id)."""
    if "_node_content" not in metadata:  # a row LlamaIndex did not write
        md = {key: value for key, value in metadata.items() if key != NODE_ID_KEY}
        return TextNode(text=text, metadata=md, **({"id_": row_id} if row_id is not None else {}))
    cls = _TEXT_RESOURCE_NODES.get(str(metadata.get("_node_type")))
    if cls is not None:
        # (metadata_dict_to_node reads a Document or an ImageDocument as a TextNode, and its
        # set_content replaces a Node's whole text_resource, path, url and mimetype with it)
        node = cls.from_json(metadata["_node_content"])
        if text:
            if node.text_resource is None:
                node.set_content(text)
            else:
                node.text_resource.text = text
        return node
    return metadata_dict_to_node(dict(metadata), text=text or None)


# The node classes whose text is a MediaResource, read back here rather than by
# metadata_dict_to_node (which knows Node, IndexNode and ImageNode, any other as a TextNode).
_TEXT_RESOURCE_NODES: dict[str, type[Node]] = {c.class_name(): c for c in (Node, Document, ImageDocument)}
