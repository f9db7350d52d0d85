//! How an HTTP request becomes a call of the gRPC service code: the path's parameters, the
//! query and the JSON body make one object, read as the method's request message with
//! proto3's JSON mapping (unknown fields refused), and the answer is the response message in
//! the same mapping.

use std::future::Future;

use axum::body::Body;
use axum::extract::{FromRequest, Path, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use tonic::{Code, Status};

use super::error::ApiError;
use crate::security::Caller;

/// Largest body the API reads, as gRPC's.
pub const MAX_BODY_BYTES: usize = crate::api::MAX_REQUEST_BYTES;

/// A request's fields, and who sent it.
pub struct Input {
    pub fields: Map<String, Value>,
    pub caller: Option<Caller>,
    /// To check again while a stream lasts.
    pub credentials: Option<super::auth::Credentials>,
}

impl<S: Send + Sync> FromRequest<S> for Input {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let (mut parts, body) = req.into_parts();
        let params = match <Path<Vec<(String, String)>> as axum::extract::FromRequestParts<S>>::from_request_parts(&mut parts, state)
            .await
        {
            Ok(p) => p.0,
            Err(axum::extract::rejection::PathRejection::MissingPathParams(_)) => Vec::new(),
            Err(e) => return Err(ApiError::bad_request(format!("malformed path: {e}"))),
        };
        let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    Code::InvalidArgument,
                    format!("the body is larger than {MAX_BODY_BYTES} bytes"),
                )
            })?;
        let mut fields = if bytes.iter().all(u8::is_ascii_whitespace) {
            Map::new()
        } else {
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(Value::Object(m)) => m,
                Ok(_) => return Err(ApiError::bad_request("the body must be a JSON object")),
                Err(e) => return Err(ApiError::bad_request(format!("malformed JSON: {e}"))),
            }
        };
        let query: Vec<(String, String)> = match parts.uri.query() {
            Some(_) => {
                axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&parts.uri)
                    .map_err(|e| ApiError::bad_request(format!("malformed query: {e}")))?
                    .0
            }
            None => Vec::new(),
        };
        for (k, v) in query {
            if fields.contains_key(&k) {
                return Err(ApiError::bad_request(format!("{k} is given twice")));
            }
            let v = match v.as_str() {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                _ => Value::String(v),
            };
            fields.insert(k, v);
        }
        for (k, v) in params {
            match fields.get(&k) {
                Some(Value::String(b)) if *b == v => {}
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "{k} in the body differs from the path's"
                    )))
                }
                None => {}
            }
            fields.insert(k, Value::String(v));
        }
        Ok(Input {
            fields,
            caller: parts.extensions.get::<Caller>().cloned(),
            credentials: parts.extensions.get::<super::auth::Credentials>().cloned(),
        })
    }
}

impl Input {
    /// The request message, with the caller in its extensions as the gRPC layer puts it.
    pub fn request<T: DeserializeOwned>(self) -> Result<tonic::Request<T>, ApiError> {
        let msg: T = serde_json::from_value(Value::Object(self.fields))
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut r = tonic::Request::new(msg);
        if let Some(c) = self.caller {
            r.extensions_mut().insert(c);
        }
        Ok(r)
    }
}

/// A JSON answer.
pub fn json<T: Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            Body::from(body),
        )
            .into_response(),
        Err(e) => ApiError::from(Status::internal(e.to_string())).into_response(),
    }
}

/// Reads `input` as `T`, calls `f` and answers its response as JSON.
pub async fn unary<T, U, F, Fut>(input: Input, f: F) -> Response
where
    T: DeserializeOwned,
    U: Serialize,
    F: FnOnce(tonic::Request<T>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<U>, Status>>,
{
    let req = match input.request() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match f(req).await {
        Ok(r) => json(r.get_ref()),
        Err(s) => ApiError::from(s).into_response(),
    }
}
