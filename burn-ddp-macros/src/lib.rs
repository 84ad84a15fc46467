//! The `#[ddp]` attribute for burn-ddp. Use it through `burn_ddp::ddp`.

use proc_macro::TokenStream;
use proc_macro2::Span;
use quote::quote;
use syn::spanned::Spanned;
use syn::{parse_macro_input, Data, DeriveInput, Error, Fields, LitStr};

/// Makes a `#[derive(Module)]` struct a data-parallel model: implements `burn_ddp::DdpModule`
/// so that `DdpSession::prepare_module` knows the struct's fields in declaration order (the
/// order of gradient buckets on every rank) and which ones are rank-local.
///
/// ```ignore
/// #[ddp]                       // above the derive
/// #[derive(Module, Debug)]
/// struct Net<B: Backend> {
///     body: Linear<B>,         // synchronised
///     #[ddp(skip)]
///     head: Linear<B>,         // rank-local: not compared, not broadcast, not averaged
/// }
/// ```
#[proc_macro_attribute]
pub fn ddp(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut input = parse_macro_input!(item as DeriveInput);
    match expand(attr.into(), &mut input) {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            let err = e.to_compile_error();
            // Keep the item (without our field attributes) so that the error above is the only one.
            strip_field_attrs(&mut input);
            quote!(#input #err).into()
        }
    }
}

fn expand(
    attr: proc_macro2::TokenStream,
    input: &mut DeriveInput,
) -> syn::Result<proc_macro2::TokenStream> {
    if !attr.is_empty() {
        return Err(Error::new(
            attr.span(),
            "#[ddp] takes no options on the struct; mark fields with #[ddp(skip)] instead",
        ));
    }
    let name = &input.ident.clone();
    let fields =
        match &input.data {
            Data::Struct(s) => match &s.fields {
                Fields::Named(f) => f,
                Fields::Unnamed(_) => {
                    return Err(Error::new(
                        name.span(),
                        "#[ddp] needs a struct with named fields (a Burn module such as \
                     `struct Net<B: Backend> { fc: Linear<B> }`): parameter names come from \
                     field names, and a tuple struct has none",
                    ))
                }
                Fields::Unit => {
                    return Err(Error::new(
                        name.span(),
                        "#[ddp] on a unit struct: it has no parameters to synchronise",
                    ))
                }
            },
            Data::Enum(e) => return Err(Error::new(
                e.enum_token.span,
                "#[ddp] supports structs only: every rank must have the same parameters, which \
                 an enum's variants cannot promise. Put #[ddp] on the struct that holds it",
            )),
            Data::Union(u) => {
                return Err(Error::new(
                    u.union_token.span,
                    "#[ddp] supports structs only, not unions",
                ))
            }
        };
    if !derives_module(input) {
        return Err(Error::new(
            name.span(),
            "#[ddp] goes on a Burn module: add #[derive(Module)] below #[ddp] (the attribute must \
             come first, so that it sees the derive)",
        ));
    }

    let mut all = Vec::new();
    let mut skip = Vec::new();
    for field in &fields.named {
        let ident = field
            .ident
            .as_ref()
            .expect("a field of `FieldsNamed` always has a name");
        let text = ident.to_string();
        let text = text.strip_prefix("r#").unwrap_or(&text).to_owned();
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("ddp")) {
            let mut skipped = false;
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("skip") {
                    skipped = true;
                    Ok(())
                } else {
                    let got = meta
                        .path
                        .get_ident()
                        .map(|i| i.to_string())
                        .unwrap_or_else(|| "this".into());
                    Err(meta.error(format!(
                        "unknown #[ddp] option `{got}`: the only field option is `skip` \
                         (#[ddp(skip)] keeps the field's parameters rank-local)"
                    )))
                }
            })?;
            if !skipped {
                return Err(Error::new(
                    attr.span(),
                    "empty #[ddp()] on a field: write #[ddp(skip)], or remove it",
                ));
            }
            skip.push(LitStr::new(&text, Span::call_site()));
        }
        all.push(LitStr::new(&text, Span::call_site()));
    }
    if !skip.is_empty() && skip.len() == all.len() {
        return Err(Error::new(
            name.span(),
            "every field of this struct is #[ddp(skip)]: nothing would be synchronised; \
             drop #[ddp] if the model is meant to stay rank-local",
        ));
    }

    strip_field_attrs(input);
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let name_lit = LitStr::new(&name.to_string(), Span::call_site());
    Ok(quote! {
        #input
        impl #impl_generics ::burn_ddp::DdpModule for #name #ty_generics #where_clause {
            const DDP_NAME: &'static str = #name_lit;
            const DDP_FIELDS: &'static [&'static str] = &[#(#all),*];
            const DDP_SKIP: &'static [&'static str] = &[#(#skip),*];
        }
    })
}

/// Whether `#[derive(..., Module, ...)]` is among the attributes still to be expanded.
fn derives_module(input: &DeriveInput) -> bool {
    input
        .attrs
        .iter()
        .filter(|a| a.path().is_ident("derive"))
        .any(|a| {
            let mut found = false;
            let _ = a.parse_nested_meta(|meta| {
                if meta
                    .path
                    .segments
                    .last()
                    .is_some_and(|s| s.ident == "Module")
                {
                    found = true;
                }
                Ok(())
            });
            found
        })
}

fn strip_field_attrs(input: &mut DeriveInput) {
    if let Data::Struct(s) = &mut input.data {
        for f in s.fields.iter_mut() {
            f.attrs.retain(|a| !a.path().is_ident("ddp"));
        }
    }
}
