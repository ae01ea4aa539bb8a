//! Chat datasets as Hugging Face `datasets` saves them (`to_parquet`, or the
//! Hub's Parquet conversion): a Parquet file with a `messages` column
//! (a list of `{role, content}` structs, OpenAI form) or a `conversations`
//! column (a list of `{from, value}`, ShareGPT form), besides any others.
//! The schema is checked before any row is read, so a file with neither
//! column, or with them holding other types, is refused naming the file and
//! the column; rows are read with only that column projected.

use std::path::Path;

use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::{ColumnDescriptor, Type};

use crate::DataError;

/// Whether a dataset path is a Parquet file (by its extension).
pub fn is_parquet(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// Every row of the file as JSON holding the chat column (`{"messages":
/// [...]}` or `{"conversations": [...]}`) and those of `extra` the file has
/// (e.g. `id`, `category`), in file order.
pub fn chat_rows(path: &Path, extra: &[&str]) -> Result<Vec<serde_json::Value>, DataError> {
    let io = |e: String| DataError::Io(path.to_path_buf(), e);
    let file = std::fs::File::open(path).map_err(|e| io(e.to_string()))?;
    let reader = SerializedFileReader::new(file).map_err(|e| io(format!("not a readable Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let root = schema.root_schema();
    let column = chat_column(path, root, schema.columns())?;
    let kept = root.get_fields().iter().filter(|f| f.name() == column || extra.contains(&f.name())).cloned().collect();
    let projection = Type::group_type_builder(root.name()).with_fields(kept).build().map_err(|e| io(e.to_string()))?;
    let rows = reader.get_row_iter(Some(projection)).map_err(|e| io(e.to_string()))?;
    rows.enumerate()
        .map(|(i, r)| r.map(|row| row.to_json_value()).map_err(|e| io(format!("row {}: {e}", i + 1))))
        .collect()
}

/// The chat column of the schema, checked: a top-level `messages` or
/// `conversations` whose leaves are the two string fields of its form.
fn chat_column(
    path: &Path,
    root: &Type,
    leaves: &[std::sync::Arc<ColumnDescriptor>],
) -> Result<&'static str, DataError> {
    let schema_err =
        |column: &str, reason: String| DataError::Schema { path: path.to_path_buf(), column: column.into(), reason };
    let names: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
    let (column, fields) = match (names.contains(&"messages"), names.contains(&"conversations")) {
        (true, false) => ("messages", ["role", "content"]),
        (false, true) => ("conversations", ["from", "value"]),
        (true, true) => {
            return Err(schema_err("messages", "has both \"messages\" and \"conversations\" columns".into()));
        }
        (false, false) => {
            return Err(schema_err(
                "messages",
                format!(
                    "has neither a \"messages\" (OpenAI) nor a \"conversations\" (ShareGPT) column; columns: {names:?}"
                ),
            ));
        }
    };
    let under: Vec<&ColumnDescriptor> = leaves
        .iter()
        .map(|c| c.as_ref())
        .filter(|c| c.path().parts().first().map(String::as_str) == Some(column))
        .collect();
    let want = format!("a list of {{{}: string, {}: string}}", fields[0], fields[1]);
    if !under.iter().any(|c| c.max_rep_level() >= 1) {
        return Err(schema_err(column, format!("is not a list (want {want})")));
    }
    for field in fields {
        let Some(leaf) = under.iter().find(|c| c.path().parts().last().map(String::as_str) == Some(field)) else {
            let found: Vec<String> = under.iter().map(|c| c.path().string()).collect();
            return Err(schema_err(column, format!("has no field \"{field}\" (want {want}; found {found:?})")));
        };
        let is_string = leaf.physical_type() == Physical::BYTE_ARRAY
            && (matches!(leaf.logical_type_ref(), Some(LogicalType::String))
                || leaf.converted_type() == ConvertedType::UTF8);
        if !is_string {
            return Err(schema_err(
                &leaf.path().string(),
                format!("is {:?} ({:?}), not a string (want {want})", leaf.physical_type(), leaf.logical_type_ref()),
            ));
        }
    }
    Ok(column)
}
