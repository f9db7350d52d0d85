//! `/api/v1/openapi.json`: the API's description, kept in the repository
//! (`docs/openapi.json`) and checked against the routes by the tests.

use axum::http::{header, HeaderValue};
use axum::routing::get;
use axum::Router;

/// The document as served.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

pub fn routes() -> Router {
    Router::new().route(
        "/api/v1/openapi.json",
        get(|| async {
            (
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                DOCUMENT,
            )
        }),
    )
}

/// The document, made from the operations table and the protobuf descriptors (with their
/// comments), so it cannot drift from what the routes read and answer. A test compares it
/// with `docs/openapi.json`; `BATON_BLESS=1` rewrites that file.
#[cfg(test)]
pub mod generate {
    use std::collections::BTreeMap;

    use pbjson_types::field_descriptor_proto::{Label, Type};
    use pbjson_types::{DescriptorProto, FileDescriptorSet};
    use prost::Message;
    use serde_json::{json, Map, Value};

    use crate::security::operations::{Access, OPERATIONS};

    struct Protos {
        messages: BTreeMap<String, (DescriptorProto, String, Vec<String>)>,
        enums: BTreeMap<String, (Vec<String>, String)>,
        methods: BTreeMap<String, (String, String, bool, String)>,
    }

    fn comment(set: &FileDescriptorSet, file: usize, path: &[i32]) -> String {
        set.file[file]
            .source_code_info
            .as_ref()
            .and_then(|i| i.location.iter().find(|l| l.path == path))
            .and_then(|l| l.leading_comments.clone())
            .map(|c| c.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    }

    fn protos() -> Protos {
        let set = FileDescriptorSet::decode(crate::proto::FILE_DESCRIPTOR_SET).unwrap();
        let mut p = Protos {
            messages: BTreeMap::new(),
            enums: BTreeMap::new(),
            methods: BTreeMap::new(),
        };
        for (fi, f) in set.file.iter().enumerate() {
            let pkg = f.package.clone().unwrap_or_default();
            for (mi, m) in f.message_type.iter().enumerate() {
                let name = format!(".{pkg}.{}", m.name());
                let fields = (0..m.field.len())
                    .map(|i| comment(&set, fi, &[4, mi as i32, 2, i as i32]))
                    .collect();
                let doc = comment(&set, fi, &[4, mi as i32]);
                for n in &m.nested_type {
                    p.messages.insert(
                        format!("{name}.{}", n.name()),
                        (n.clone(), String::new(), vec![String::new(); n.field.len()]),
                    );
                }
                p.messages.insert(name, (m.clone(), doc, fields));
            }
            for (ei, e) in f.enum_type.iter().enumerate() {
                let values = e.value.iter().map(|v| v.name().to_string()).collect();
                p.enums.insert(
                    format!(".{pkg}.{}", e.name()),
                    (values, comment(&set, fi, &[5, ei as i32])),
                );
            }
            for (si, s) in f.service.iter().enumerate() {
                for (mi, m) in s.method.iter().enumerate() {
                    p.methods.insert(
                        format!("/{pkg}.{}/{}", s.name(), m.name()),
                        (
                            m.input_type().to_string(),
                            m.output_type().to_string(),
                            m.server_streaming(),
                            comment(&set, fi, &[6, si as i32, 2, mi as i32]),
                        ),
                    );
                }
            }
        }
        p
    }

    fn short(type_name: &str) -> String {
        type_name.trim_start_matches(".baton.v1.").to_string()
    }

    impl Protos {
        fn field_schema(&self, f: &pbjson_types::FieldDescriptorProto) -> Value {
            let one = match f.r#type() {
                Type::Double | Type::Float => json!({"type": "number"}),
                Type::Int32 | Type::Sint32 | Type::Sfixed32 => {
                    json!({"type": "integer", "format": "int32"})
                }
                Type::Uint32 | Type::Fixed32 => {
                    json!({"type": "integer", "format": "int32", "minimum": 0})
                }
                Type::Int64 | Type::Sint64 | Type::Sfixed64 | Type::Uint64 | Type::Fixed64 => {
                    json!({"type": "string", "format": "int64", "description": "A 64-bit integer, as a string (numbers are accepted too)."})
                }
                Type::Bool => json!({"type": "boolean"}),
                Type::String => json!({"type": "string"}),
                Type::Bytes => json!({"type": "string", "format": "byte"}),
                Type::Enum => {
                    json!({"$ref": format!("#/components/schemas/{}", short(f.type_name()))})
                }
                Type::Message | Type::Group => match f.type_name() {
                    ".google.protobuf.Timestamp" => {
                        json!({"type": "string", "format": "date-time"})
                    }
                    ".google.protobuf.Duration" => {
                        json!({"type": "string", "description": "Seconds with an `s`: `90s`, `1.5s`."})
                    }
                    t => match self.messages.get(t) {
                        Some((m, _, _)) if m.options.as_ref().is_some_and(|o| o.map_entry()) => {
                            return json!({"type": "object", "additionalProperties": self.field_schema(&m.field[1])});
                        }
                        _ => json!({"$ref": format!("#/components/schemas/{}", short(t))}),
                    },
                },
            };
            if f.label() == Label::Repeated {
                json!({"type": "array", "items": one})
            } else {
                one
            }
        }

        fn schema(&self, name: &str) -> Value {
            if let Some((values, doc)) = self.enums.get(name) {
                return json!({"type": "string", "enum": values, "description": doc});
            }
            let (m, doc, docs) = &self.messages[name];
            let mut props = Map::new();
            for (f, d) in m.field.iter().zip(docs) {
                let mut s = self.field_schema(f);
                if !d.is_empty() {
                    if s.get("$ref").is_some() {
                        s = json!({"allOf": [s], "description": d});
                    } else {
                        s["description"] = json!(d);
                    }
                }
                props.insert(f.name().to_string(), s);
            }
            json!({"type": "object", "description": doc, "properties": props, "additionalProperties": false})
        }

        /// Every message and enum `root` reaches.
        fn reach(&self, root: &str, out: &mut BTreeMap<String, Value>) {
            let key = short(root);
            if out.contains_key(&key) || root.starts_with(".google.") {
                return;
            }
            if self
                .messages
                .get(root)
                .is_some_and(|(m, _, _)| m.options.as_ref().is_some_and(|o| o.map_entry()))
            {
                for f in &self.messages[root].0.field {
                    self.reach(f.type_name(), out);
                }
                return;
            }
            if !self.messages.contains_key(root) && !self.enums.contains_key(root) {
                return;
            }
            out.insert(key, self.schema(root));
            if let Some((m, _, _)) = self.messages.get(root) {
                for f in &m.field {
                    if matches!(f.r#type(), Type::Message | Type::Enum) {
                        self.reach(f.type_name(), out);
                    }
                }
            }
        }
    }

    fn error() -> Value {
        json!({"description": "An error: the gRPC code's name and a message.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
    }

    fn path_params(route: &str) -> Vec<String> {
        route
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(str::to_string)
            .collect()
    }

    /// The operations only HTTP serves.
    fn http_only(route: &str) -> (&'static str, &'static str, Value) {
        match route {
            "/api/v1/whoami" => (
                "WhoAmI",
                "The caller as this replica sees it: name and role (what the console offers), whether authentication is on, and the replica.",
                json!({"description": "OK", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WhoAmI"}}}}),
            ),
            "/api/v1/events" => (
                "Events",
                "What a console page needs to stay current, as server-sent events read with fetch() (the token in the Authorization header): `snapshot` first, then `update` when something changed (at most 4 a second), each with the job counts, the leader and workers when they changed, and which jobs (ids, or \"all\") and other things changed; `error` ends the stream (its token was revoked). At most --http-max-streams streams at once, then 503.",
                json!({"description": "Server-sent events; each `data:` a JSON object.", "content": {"text/event-stream": {"schema": {"type": "string"}}}}),
            ),
            other => panic!("{other}: no description of this HTTP-only operation"),
        }
    }

    pub fn document() -> Value {
        let p = protos();
        let mut schemas = BTreeMap::new();
        let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
        for op in OPERATIONS {
            let Some((method, route)) = op.http else {
                continue;
            };
            if !route.starts_with("/api/v1/") || route == "/api/v1/openapi.json" {
                continue;
            }
            let role = match op.access {
                Access::Open => "none".to_string(),
                Access::Needs(r) => r.as_str().to_string(),
            };
            let mut o = Map::new();
            let params = path_params(route);
            let mut parameters: Vec<Value> = params
                .iter()
                .map(|n| json!({"name": n, "in": "path", "required": true, "schema": {"type": "string"}}))
                .collect();
            let (summary, answer) = match op.grpc {
                Some(g) => {
                    let (input, output, streaming, doc) = &p.methods[g];
                    let name = g.rsplit('/').next().unwrap();
                    o.insert("operationId".into(), json!(name));
                    p.reach(input, &mut schemas);
                    p.reach(output, &mut schemas);
                    if method == "GET" {
                        let (m, _, docs) = &p.messages[input.as_str()];
                        for (f, d) in m.field.iter().zip(docs) {
                            if !params.iter().any(|x| x == f.name()) {
                                parameters.push(json!({"name": f.name(), "in": "query", "required": false, "description": d, "schema": p.field_schema(f)}));
                            }
                        }
                    } else {
                        o.insert("requestBody".into(), json!({"required": false, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{}", short(input))}}}}));
                    }
                    let answer = if name == "GetJobLogs"
                        || (*streaming && output.ends_with("LogChunk"))
                    {
                        json!({"description": "The output, as text (never HTML).", "content": {"text/plain": {"schema": {"type": "string"}}}})
                    } else if *streaming {
                        json!({"description": format!("Server-sent events, each `data:` a {}; `event: error` ends the stream.", short(output)), "content": {"text/event-stream": {"schema": {"type": "string"}}}})
                    } else {
                        json!({"description": "OK", "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{}", short(output))}}}})
                    };
                    (
                        if doc.is_empty() {
                            name.to_string()
                        } else {
                            doc.clone()
                        },
                        answer,
                    )
                }
                None => {
                    let (id, summary, answer) = http_only(route);
                    o.insert("operationId".into(), json!(id));
                    (summary.to_string(), answer)
                }
            };
            o.insert("summary".into(), json!(summary));
            o.insert("x-baton-role".into(), json!(role));
            if !parameters.is_empty() {
                o.insert("parameters".into(), json!(parameters));
            }
            o.insert(
                "responses".into(),
                json!({"200": answer, "default": error()}),
            );
            paths
                .entry(route.to_string())
                .or_default()
                .insert(method.to_ascii_lowercase(), Value::Object(o));
        }
        schemas.insert("Error".into(), json!({"type": "object", "properties": {"code": {"type": "string", "description": "The gRPC code's name: NOT_FOUND, INVALID_ARGUMENT, ..."}, "message": {"type": "string"}}, "required": ["code", "message"]}));
        schemas.insert("WhoAmI".into(), json!({"type": "object", "properties": {"name": {"type": "string"}, "role": {"type": "string", "enum": ["read", "submit", "admin"]}, "authentication": {"type": "boolean"}, "replica_id": {"type": "string"}}}));
        json!({
            "openapi": "3.1.0",
            "info": {
                "title": "Baton HTTP API",
                "version": "v1",
                "description": "The JSON API of a Baton replica (`--http-listen`). Each operation calls the same service code as its gRPC method; messages follow proto3's JSON mapping with the .proto field names. Errors carry the gRPC code's name. Operations need the role in `x-baton-role`, sent as `Authorization: Bearer <token>` when authentication is on. Requests that change something must be `Content-Type: application/json`."
            },
            "servers": [{"url": "/"}],
            "security": [{"bearer": []}],
            "paths": paths,
            "components": {
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                "schemas": schemas,
            },
        })
    }

    #[test]
    fn the_kept_document_is_the_generated_one() {
        let doc = serde_json::to_string_pretty(&document()).unwrap() + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");
        if std::env::var_os("BATON_BLESS").is_some() {
            std::fs::write(path, &doc).unwrap();
            return;
        }
        assert!(
            super::DOCUMENT == doc,
            "docs/openapi.json is not what the operations and the protos give; run `BATON_BLESS=1 cargo test --lib openapi` and rebuild"
        );
    }

    #[test]
    fn every_api_operation_is_documented_with_its_role() {
        let doc = document();
        for op in OPERATIONS {
            let Some((method, route)) = op.http else {
                continue;
            };
            if !route.starts_with("/api/v1/") || route == "/api/v1/openapi.json" {
                continue;
            }
            let o = &doc["paths"][route][method.to_ascii_lowercase()];
            let Access::Needs(role) = op.access else {
                panic!("{route} is open")
            };
            assert_eq!(o["x-baton-role"], json!(role.as_str()), "{method} {route}");
        }
    }
}
